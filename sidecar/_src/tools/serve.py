"""``sidecar serve``: one sidecar from the command line. Its options from the flags and the
environment (``core/options.ServerOptions``), the mounts and memory checked before the arena is
made (``server/preflight.py``), the user's modules imported, the server started; then SIGTERM
or SIGINT stops it, SIGHUP reloads its pool file, and ``--exit-with-parent`` ties it to the
process that started it. The flags are ``cli.py``'s (every command's are)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from sidecar._src.arena import shm
from sidecar._src.core import env as env_lib, errors, logs, options as options_lib, platform
from sidecar._src.user import registry as registry_lib

log = logging.getLogger("sidecar")


def _import_from_cwd() -> None:
  """Puts the working directory first on sys.path, as ``python -m`` does.

  The ``sidecar`` script's own directory is first instead, so ``--import my_pkg.mod``
  would not find ``my_pkg`` where the user stands; ``sidecar local`` runs its sidecars
  with ``python -m``, which finds it.
  """
  cwd = os.getcwd()
  if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
    sys.path.insert(0, cwd)


def load_user_code(modules: Sequence[str]) -> None:
  """Imports ``modules`` and the ``sidecar.plugins`` entry points, so decorators register."""
  _import_from_cwd()
  try:
    registry_lib.load_modules(modules)
  except ImportError as e:
    raise SystemExit(f"sidecar serve: {e}") from e


def replica_hosts(args: argparse.Namespace) -> tuple[str, ...]:
  """``--replica-hosts``, else (with no ``--replica-hosts-file``) the job's sidecars as
  ``SIDECAR_HOSTS`` or a JobSet's variables name them in the sidecar's environment, else
  none."""
  if args.replica_hosts:
    return tuple(e.strip() for e in args.replica_hosts.split(",") if e.strip())
  if args.replica_hosts_file:
    return ()
  from sidecar._src.controller import discovery
  env = os.environ
  named = env.get(env_lib.HOSTS, "").strip() or all(
      env.get(n, "").strip() for n in discovery.JOBSET_VARS)
  return tuple(e.address for e in discovery.endpoints_from_env(env)) if named else ()


def run(args: argparse.Namespace) -> int:
  """Serves until SIGTERM or SIGINT; returns the exit status (2: a flag or the machine is
  wrong, said in one line)."""
  platform.apply_to_sidecar()  # JAX on the CPU, before anything imports it: never the chip
  imports = list(args.imports or []) + [
      m for m in (env_lib.get(env_lib.IMPORTS) or "").split(",") if m.strip()]
  try:  # --token-file, else $SIDECAR_TOKEN, else $SIDECAR_TOKEN_FILE; an empty file is an error
    token = env_lib.token(args.token_file)
    replica_token = env_lib.replica_token(args.peer_token_file)
    client_tokens = env_lib.client_tokens(args.client_tokens)
    hosts = replica_hosts(args)
  except (OSError, errors.InvalidArgumentError) as e:
    print(f"sidecar serve: {e}", file=sys.stderr)
    return 2
  # Loopback unless a token guards the ports: then every interface, so peers reach it.
  pool = os.path.abspath(args.pool) if args.pool else None
  if pool is not None and (token or client_tokens):  # the pool file holds every token
    token, client_tokens = None, ()
  listen = args.listen or (options_lib.ALL_INTERFACES if token or client_tokens or pool
                           else options_lib.LOOPBACK)
  try:
    opts = options_lib.ServerOptions(
        host_id=args.host_id, slice_id=args.slice_id, device_ids=args.device_ids,
        listen=listen, port=args.port, health_port=args.health_port,
        socket_path=args.socket, shm_size=args.shm_size, token=token,
        replica_token=replica_token, client_tokens=client_tokens, pool=pool,
        operator_token_file=args.operator_token_file,
        replica_hosts=hosts, replica_hosts_file=args.replica_hosts_file,
        insecure=args.insecure, imports=tuple(imports),
        checkpoint_roots=tuple(os.path.abspath(r) for r in args.checkpoint_roots),
        metrics_port=args.metrics_port, session_quota=args.session_quota,
        stall_timeout_s=args.stall_timeout, feed_idle_s=args.feed_idle_s,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        socket_group=args.socket_group)
  except ValueError as e:
    print(f"sidecar serve: {e}", file=sys.stderr)
    return 2
  # The mounts and the memory first, in a fraction of a second: the user's modules and the
  # server import jax, grain and gRPC, which take seconds (20 s in a container on a loaded
  # machine).
  from sidecar._src.server import preflight
  try:
    preflight.check(opts)
  except (errors.ArenaCapacityError, OSError) as e:
    print(f"sidecar serve: {e}", file=sys.stderr)
    return 2
  load_user_code(imports)
  from sidecar._src.server.server import Server
  server = Server(opts)
  try:
    server.start()
  except (errors.ArenaCapacityError, errors.InvalidArgumentError, OSError) as e:
    print(f"sidecar serve: {e}", file=sys.stderr)
    return 2
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: threading.Thread(target=server.stop).start())
  # SIGHUP (a closed terminal, a reload by habit) used to end it: it reloads the pool file,
  # if there is one, and nothing else.
  signal.signal(signal.SIGHUP, lambda *_: threading.Thread(
      target=_reload, args=(server,), name="sidecar-reload").start())
  if args.exit_with_parent:
    threading.Thread(target=_watch_parent, args=(args.exit_with_parent, server),
                     daemon=True).start()
  if args.ready_file:
    server.write_ready_file(args.ready_file)
  metrics = ("" if server.metrics_port is None else ", metrics http://"
             f"{options_lib.LOOPBACK if opts.unix else opts.listen}:{server.metrics_port}/metrics")
  health = "on the same socket" if opts.unix else server.health_port
  serving = (f"sidecar host {opts.host_id} serving on {server.address} (health {health}), "
             f"worker socket {opts.socket_path}, arena {shm.format_size(opts.shm_size)}{metrics}")
  if args.log_format == logs.JSON:  # every line of the container's log is JSON
    log.info("%s", serving)
  else:
    print(serving, flush=True)
  while not server.wait(1.0):
    pass
  return 0


def _reload(server) -> None:
  """SIGHUP: the pool file read again; a bad one is logged and changes nothing."""
  if server.options.pool is None:
    log.warning("got SIGHUP; ignored: this sidecar has no pool file (--pool) to reload "
                "(SIGTERM stops it)")
    return
  try:
    server.reload()
  except (errors.SidecarError, OSError) as e:
    log.error("got SIGHUP; the pool file was not reloaded, the tenants stay as they were: %s",
              e)


def _watch_parent(pid: int, server) -> None:
  while True:
    if os.getppid() != pid:
      log.warning("parent process %d is gone; stopping", pid)
      server.stop(grace=0)
      return
    time.sleep(0.5)
