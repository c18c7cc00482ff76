"""The ``sidecar`` command line: every command's flags, and each command handed to the module
that runs it (``serve.py``, ``local_command.py``, ``launch.py``, ``controller/status.py``,
``health.py``, ``pool_status.py``, ``ram_tier_cli.py``, ``demo.py``, ``k8s/``, ``slurm/``)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from sidecar._src.core import env as env_lib, errors, logs, options as options_lib, stall
from sidecar._src.tools import (
  cli_format,
  cli_types,
  goodput_cli,
  launch,
  pool_status,
  ram_tier_cli,
  serve,
  sidecar_logs,
  torchrun,
)
from sidecar._src.tools.k8s import cli as k8s_cli
from sidecar._src.tools.slurm import cli as slurm_cli

# Each command imports what it runs (the server, the controller, JAX) when it runs, so
# `sidecar status`, `sidecar launch` and `--help` start in a fraction of a second.

log = logging.getLogger("sidecar")


def _env(name: str, default: Any = None) -> Any:
  """``$name`` (a name in env.py's table), else ``default`` when unset or empty."""
  value = env_lib.get(name)
  return default if value is None else value


def _raise_on_sigterm() -> None:
  """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so ``with`` blocks clean up."""
  def handler(signum, frame):
    raise KeyboardInterrupt
  signal.signal(signal.SIGTERM, handler)


def _local(args: argparse.Namespace) -> int:
  for flag, value in (("--hosts", args.hosts), ("--devices-per-host", args.devices_per_host)):
    if value < 1:
      args.parser.error(f"{flag} must be at least 1, got {value}")
  _raise_on_sigterm()
  try:
    return _run_local(args)
  except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the sidecars start
    return 130


def _run_local(args: argparse.Namespace) -> int:
  from sidecar._src.tools import local_command
  return local_command.run(args)


def _launch(args: argparse.Namespace) -> int:
  command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
  if not command:
    args.parser.error("CMD is missing: give the trainer command after --, "
                      "e.g. sidecar launch --hosts 2 -- python train.py")
  for flag, value in (("--hosts", args.hosts), ("--devices-per-host", args.devices_per_host),
                      ("--procs-per-host", args.procs_per_host)):
    if value < 1:
      args.parser.error(f"{flag} must be at least 1, got {value}")
  try:
    token = env_lib.token(args.token_file)
  except (OSError, errors.InvalidArgumentError) as e:
    args.parser.error(f"cannot read the token: {e}")
  if args.min_hosts is not None and not args.elastic:
    args.parser.error("--min-hosts applies only with --elastic")
  if args.in_place and not args.elastic:
    args.parser.error("--in-place applies only with --elastic")
  if args.in_place and args.min_hosts is not None:
    args.parser.error("--min-hosts does not apply with --in-place: the job keeps its size")
  if args.max_restarts is not None and args.elastic and not args.in_place:
    args.parser.error("--max-restarts applies without --elastic, or with --elastic --in-place: "
                      "--elastic alone restarts while --min-hosts hosts remain")
  if args.max_restarts is not None and args.max_restarts < 0:
    args.parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
  if args.preload and not args.standby:
    args.parser.error("--preload applies only with --standby")
  if not 0 <= args.stall_timeout < float("inf"):
    args.parser.error(f"--stall-timeout must be seconds >= 0 (0: off), got {args.stall_timeout}")
  if args.save_grace < 0:
    args.parser.error(f"--save-grace must be >= 0 seconds, got {args.save_grace:g}")
  min_hosts = 1 if args.min_hosts is None else args.min_hosts
  if not 1 <= min_hosts <= args.hosts:
    args.parser.error(f"--min-hosts must be in 1..--hosts ({args.hosts}), got {min_hosts}")
  return launch.run(command, hosts=args.hosts, devices_per_host=args.devices_per_host,
                    imports=args.imports or [], shm_size=args.shm_size, token=token,
                    elastic=args.elastic, min_hosts=min_hosts, in_place=args.in_place,
                    checkpoint_roots=args.checkpoint_roots,
                    max_restarts=args.max_restarts,
                    procs_per_host=args.procs_per_host, torch=args.torch,
                    standby=(args.preload or []) if args.standby else None,
                    stall_timeout=args.stall_timeout,
                    log_dir=sidecar_logs.base_dir(args.log_dir), save_grace=args.save_grace)


def _stalls(args: argparse.Namespace) -> int:
  from sidecar._src.tools import stalls
  return stalls.probe(cli_types.addresses(args), token=cli_types.token(args),
                      timeout=args.timeout, send_stacks=args.stacks,
                      say=lambda text: print(f"sidecar stalls: {text}", flush=True))


def _status(args: argparse.Namespace) -> int:
  from sidecar._src.controller import status as status_lib
  token = cli_types.token(args)
  addresses = cli_types.addresses(args)
  if args.watch and args.json:
    args.parser.error("--watch and --json do not go together: pick one")
  if args.interval <= 0:
    args.parser.error(f"--interval must be a positive number of seconds, got {args.interval}")
  if args.watch:
    _raise_on_sigterm()
    return status_lib.watch(addresses, interval=args.interval, timeout=args.timeout,
                        token=token)
  return status_lib.print_status(addresses, timeout=args.timeout, token=token, as_json_=args.json)


def _health(args: argparse.Namespace) -> int:
  from sidecar._src.tools import health
  if args.timeout <= 0:
    args.parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
  serving, answer = health.check(args.address, timeout=args.timeout)
  print(answer, file=sys.stdout if serving else sys.stderr)
  return 0 if serving else 1


def _demo(args: argparse.Namespace) -> int:
  try:
    if args.torch:
      from sidecar._src.tools import torch_demo
      return torch_demo.run(hosts=args.hosts, steps=args.steps if args.steps != 300 else 60)
    from sidecar._src.tools import demo
    return demo.run(hosts=args.hosts, devices_per_host=args.devices_per_host,
                    steps=args.steps, processes=args.processes, elastic=args.elastic,
                    verbose=args.verbose)
  except KeyboardInterrupt:  # before the demo began (importing JAX), or in the torch demo
    print("sidecar demo: interrupted", file=sys.stderr)
    return 130


def _from_env(var: str, otherwise: str) -> str:
  return f"(default: ${var}, else {otherwise})"


def _log_dir_flag(p: argparse.ArgumentParser) -> None:
  """``--log-dir`` of ``sidecar local`` and ``launch``: where each run keeps its sidecars' logs."""
  p.add_argument("--log-dir", metavar="DIR",
                 help="keep the sidecars' logs in DIR/RUN/host<i>.log (RUN: the start's date, "
                      "time and this process's pid), printed at start and kept afterwards "
                      + _from_env(env_lib.LOG_DIR, "./sidecar-logs"))


def _checkpoint_root_flag(p: argparse.ArgumentParser) -> None:
  """``--checkpoint-root`` of ``sidecar local`` and ``launch``: every sidecar gets them."""
  p.add_argument("--checkpoint-root", dest="checkpoint_roots", action="append", metavar="DIR",
                 type=os.path.abspath,
                 help="directory every sidecar may checkpoint in, and below (repeatable; "
                      "default: the temp directory and the working directory)")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="sidecar", description=(
      "colocated-sidecar: data loading and checkpointing on the accelerator hosts."),
      formatter_class=cli_format.DefaultsFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  add = functools.partial(sub.add_parser, formatter_class=cli_format.DefaultsFormatter)

  s = add("serve", help="run the sidecar of this host",
          description="Run this host's sidecar: import the modules that register functions, "
                      "pipelines and checkpoint writers, create the arena, and serve gRPC "
                      "until SIGTERM or Ctrl-C. Every flag's default can come from a "
                      "SIDECAR_* variable, as the Kubernetes manifests set them.")
  # String defaults (a SIDECAR_ variable's text): argparse reads them with the flag's type only
  # when the flag is not given, so a bad value is `sidecar serve: error: argument --port`.
  s.add_argument("--host-id", type=int, default=_env(env_lib.HOST_ID, "0"),
                 help="this host's id, 0..N-1 in host order " + _from_env(env_lib.HOST_ID, "0"))
  s.add_argument("--slice-id", type=int, default=_env(env_lib.SLICE_ID, "0"),
                 help="the slice this host belongs to " + _from_env(env_lib.SLICE_ID, "0"))
  s.add_argument("--device-ids", type=cli_types.ids, default=_env(env_lib.DEVICE_IDS, ""),
                 metavar="IDS", help="the JAX device ids this host owns, comma-separated, e.g. "
                 "0,1; feeds place rows by them " + _from_env(env_lib.DEVICE_IDS, "none"))
  s.add_argument("--listen", default=_env(env_lib.LISTEN), metavar="ADDR",
                 help="unix:PATH: serve gRPC, reflection and health on that Unix socket (no "
                      "port, nothing on the network, no token needed: the file's mode 0600 "
                      "is the access control); or a TCP address for the control and health "
                      "ports, where a non-loopback one needs --token-file or --insecure "
                      + _from_env(env_lib.LISTEN, "127.0.0.1, or [::] with a token"))
  s.add_argument("--socket-group", default=_env(env_lib.SOCKET_GROUP), metavar="GROUP",
                 help="with --listen unix:PATH: this group may connect too (mode 0660) "
                      + _from_env(env_lib.SOCKET_GROUP, "none: mode 0600, this user only"))
  s.add_argument("--port", type=int, default=_env(env_lib.PORT, str(options_lib.DEFAULT_PORT)),
                 help="the gRPC control port (TCP only); 0 picks a free one "
                      + _from_env(env_lib.PORT, str(options_lib.DEFAULT_PORT)))
  s.add_argument("--health-port", type=int,
                 default=_env(env_lib.HEALTH_PORT, str(options_lib.DEFAULT_HEALTH_PORT)),
                 help="the plaintext grpc.health.v1 port, for the kubelet's probes (TCP "
                      "only: a unix: sidecar answers health on its socket); 0 picks a free "
                      "one " + _from_env(env_lib.HEALTH_PORT, str(options_lib.DEFAULT_HEALTH_PORT)))
  s.add_argument("--socket", default=_env(env_lib.SOCKET, "/run/sidecar/sidecar.sock"),
                 metavar="PATH", help="the Unix socket the workers attach to "
                 + _from_env(env_lib.SOCKET, "/run/sidecar/sidecar.sock"))
  s.add_argument("--shm-size", type=cli_types.size, default=_env(env_lib.SHM_SIZE, "1GiB"),
                 metavar="SIZE", help="arena size, e.g. 4GiB; checked against what the "
                 "machine can give at start " + _from_env(env_lib.SHM_SIZE, "1GiB"))
  s.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                 help="module whose decorators register functions, pipelines and checkpoint "
                      "writers (repeatable; $SIDECAR_IMPORTS adds a comma-separated list; "
                      "default: none)")
  s.add_argument("--token-file", default=_env(env_lib.TOKEN_FILE), metavar="FILE",
                 help="file holding the token every controller must present "
                      "(default: $SIDECAR_TOKEN_FILE; $SIDECAR_TOKEN gives the token itself; "
                      "else no token, loopback only)")
  s.add_argument("--client-tokens", default=_env(env_lib.CLIENT_TOKENS_FILE), metavar="FILE",
                 help="instead of one shared token: a file of per-client tokens, one 'NAME "
                      "TOKEN' a line; each client then sees and reads only the checkpoint "
                      "directories it opened through the Checkpoint rpcs. It does NOT isolate "
                      "memory: every client's Worker maps the one arena, RAM-tier steps and "
                      "batches of the others included; clients that must not see each "
                      "other's memory need a pool file (--pool: an arena per tenant) "
                      "(default: $SIDECAR_CLIENT_TOKENS_FILE, else the shared token of "
                      "--token-file)")
  s.add_argument("--pool", metavar="FILE",
                 help="a pool file (YAML): tenants, each with its token file and quotas (arena "
                      "share and ceiling, sessions, feeds, ...), instead of --token-file or "
                      "--client-tokens; SIGHUP reloads it; docs/pool.md (default: none)")
  s.add_argument("--operator-token-file", metavar="FILE",
                 help="with --pool, where the pool file names no operator_token_file: the "
                      "file holding the pool's operator token, which reads every tenant's "
                      "row (sidecar pool status) and drops RAM-tier copies, and is no "
                      "tenant; reread on SIGHUP; docs/pool.md (default: none)")
  s.add_argument("--peer-token-file", default=_env(env_lib.PEER_TOKEN_FILE), metavar="FILE",
                 help="file holding the token this job's sidecars present to each other: "
                      "only they may send replicas, never a controller (default: "
                      "$SIDECAR_PEER_TOKEN_FILE; $SIDECAR_PEER_TOKEN gives it itself; else "
                      "none: no replicas are accepted)")
  s.add_argument("--replica-hosts", default=_env(env_lib.REPLICA_HOSTS), metavar="LIST",
                 help="the job's sidecars in host order, HOST:PORT or unix:PATH, "
                      "comma-separated: the only places this one sends replicas to (a client "
                      "names a host id, never an address) (default: $SIDECAR_REPLICA_HOSTS, "
                      "else SIDECAR_HOSTS' or a JobSet's sidecars where the environment "
                      "names them, else none: no replicas are sent)")
  s.add_argument("--replica-hosts-file", default=_env(env_lib.REPLICA_HOSTS_FILE),
                 metavar="FILE",
                 help="instead of --replica-hosts: a file holding that list, read when a "
                      "replica link is made (for launchers that learn the ports after "
                      "start) (default: $SIDECAR_REPLICA_HOSTS_FILE, else none)")
  s.add_argument("--session-quota", type=cli_types.quota, metavar="SHARE",
                 default=_env(env_lib.SESSION_QUOTA, "0.9"),
                 help="what one worker session may hold of the arena: a fraction (0.5) or a "
                      "size (2GiB), so no client takes all of it "
                      + _from_env(env_lib.SESSION_QUOTA, "0.9"))
  s.add_argument("--stall-timeout", type=float, metavar="SECONDS",
                 default=_env(env_lib.STALL_TIMEOUT, f"{stall.DEFAULT_FLOOR_S:g}"),
                 help=f"a trainer is stalled after {stall.RULE}: Status, /metrics and "
                      "`sidecar stalls` say so (sidecar launch restarts it); 0: never "
                      + _from_env(env_lib.STALL_TIMEOUT, f"{stall.DEFAULT_FLOOR_S:g}"))
  s.add_argument("--feed-idle-s", type=float, metavar="SECONDS",
                 default=options_lib.FEED_IDLE_S,
                 help="how long an ended feed's worker processes stay idle, for the next "
                      "feed of the same pipeline, arguments, seed and rows (a rollback's, a "
                      "restarted trainer's) to adopt instead of starting new ones; counted "
                      "against a pool tenant's feed_workers; 0: they stop with their feed "
                      f"(default: {options_lib.FEED_IDLE_S:g})")
  s.add_argument("--insecure", action="store_true", default=_env(env_lib.INSECURE) == "1",
                 help="allow a non-loopback --listen without a token, logged as a warning "
                      "(default: off, or on with SIDECAR_INSECURE=1)")
  s.add_argument("--checkpoint-root", dest="checkpoint_roots", action="append", metavar="DIR",
                 default=[r for r in (_env(env_lib.CHECKPOINT_ROOTS) or "").split(os.pathsep)
                          if r.strip()],
                 help="directory the checkpoint calls may act in, and below (repeatable; "
                      "default: $SIDECAR_CHECKPOINT_ROOTS, else none: checkpoints are refused)")
  s.add_argument("--metrics-port", type=int, metavar="PORT",
                 default=_env(env_lib.METRICS_PORT),
                 help="serve Prometheus metrics on http://LISTEN:PORT/metrics, on the address "
                      "of --listen (0 picks a free port; default: $SIDECAR_METRICS_PORT, else "
                      "no metrics)")
  s.add_argument("--log-format", choices=logs.FORMATS, default=_env(env_lib.LOG_FORMAT, "text"),
                 help="text, or json: one JSON object a line, with time, level, logger, "
                      "message, host_id, and session or step where they apply "
                      + _from_env(env_lib.LOG_FORMAT, "text"))
  s.add_argument("--tls-cert", default=_env(env_lib.TLS_CERT), metavar="PEM",
                 help="TLS on the control port: its certificate chain (with --tls-key) "
                      + _from_env(env_lib.TLS_CERT, "no TLS"))
  s.add_argument("--tls-key", default=_env(env_lib.TLS_KEY), metavar="PEM",
                 help="the private key of --tls-cert " + _from_env(env_lib.TLS_KEY, "none"))
  s.add_argument("--tls-client-ca", default=_env(env_lib.TLS_CLIENT_CA), metavar="PEM",
                 help="mTLS: controllers must present a certificate this CA signed "
                      + _from_env(env_lib.TLS_CLIENT_CA, "no mTLS"))
  s.add_argument("--ready-file", help=argparse.SUPPRESS)
  s.add_argument("--exit-with-parent", type=int, help=argparse.SUPPRESS)
  s.set_defaults(func=serve.run)

  s = add("local", help="run a LocalCluster until Ctrl-C",
          description="Start N sidecars on this machine (sidecar.testing.LocalCluster) and "
                      "print their addresses and worker sockets; connect a Controller or a "
                      "notebook to them. Ctrl-C or SIGTERM stops them.")
  s.add_argument("--hosts", type=int, default=2, help="sidecars to start")
  s.add_argument("--devices-per-host", type=int, default=1,
                 help="device ids each sidecar declares (host h owns h*D..h*D+D-1)")
  s.add_argument("--shm-size", type=cli_types.size, default="256MiB", metavar="SIZE",
                 help="each sidecar's arena size (default: 256MiB)")
  s.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                 help="module each sidecar imports, so its decorators register (repeatable; "
                      "default: none)")
  s.add_argument("--metrics", action="store_true",
                 help="each sidecar serves Prometheus /metrics on a free port, printed "
                      "(default: off)")
  _checkpoint_root_flag(s)
  _log_dir_flag(s)
  s.add_argument("--pool", metavar="FILE",
                 help="a pool file: each sidecar serves its tenants, each with its token and "
                      "quotas (sidecar serve --pool); SIGHUP to this command reloads it on "
                      "every sidecar and prints what each answered; docs/pool.md (default: "
                      "none)")
  s.set_defaults(func=_local, parser=s)

  s = sub.add_parser("launch", help="run N sidecars and N copies of a trainer command here",
                     usage="sidecar launch [options] -- CMD [ARGS...]", epilog=launch.HELP,
                     description="Local multi-process mode, as torchrun: N sidecars on this "
                                 "machine and one trainer process (or P) beside each.",
                     formatter_class=cli_format.RawDescriptionDefaultsFormatter)
  s.add_argument("--hosts", type=int, default=2,
                 help="sidecars and trainers (default: 2)")
  s.add_argument("--devices-per-host", type=int, default=1,
                 help="CPU devices of each trainer, SIDECAR_LOCAL_DEVICES (default: 1)")
  s.add_argument("--procs-per-host", type=int, default=1, metavar="P",
                 help="trainer processes beside each sidecar, each its own Worker session, "
                 "as torchrun --nproc-per-node (default: 1)")
  s.add_argument("--torch", action="store_true",
                 help="also set torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, "
                 "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, "
                 "TORCHELASTIC_RESTART_COUNT, ... (default: off)")
  s.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                 help="module each sidecar imports, so its decorators register (repeatable; "
                      "default: none)")
  s.add_argument("--shm-size", type=cli_types.size, default="256MiB",
                 help="each sidecar's arena size (default: 256MiB)")
  s.add_argument("--token-file", help="file with the sidecars' bearer token, also given to the "
                 "trainers (default: $SIDECAR_TOKEN or $SIDECAR_TOKEN_FILE, else none)")
  s.add_argument("--elastic", action="store_true",
                 help="when a host is lost, restart the other hosts' trainers as a job of one "
                 "host fewer, beside the same sidecars (see below; default: off)")
  s.add_argument("--min-hosts", type=int, metavar="K",
                 help="with --elastic: restart while at least K hosts remain (default: 1)")
  s.add_argument("--in-place", action="store_true",
                 help="with --elastic: restart at full size, as Kubernetes restarts containers "
                 "in place: a dead sidecar starts again empty, every trainer restarts "
                 "(default: off)")
  s.add_argument("--max-restarts", type=int, metavar="N",
                 help="restart at most N times, then end on the next failure: a failed "
                 "trainer restarts every trainer beside the same sidecars, as torchrun's "
                 "(default: 0; with --elastic --in-place, which also restarts a dead sidecar: "
                 f"{launch.DEFAULT_MAX_RESTARTS})")
  s.add_argument("--standby", action="store_true",
                 help="with restarts: keep each trainer's next process started, its imports "
                 "(JAX's, --preload's) done, waiting to take over when the trainer dies: a "
                 "restart skips Python's start and the imports; where a file it imported "
                 "changed since, a fresh process runs instead, with one line naming it. CMD "
                 "must be `python SCRIPT` or `python -m MODULE` (default: off)")
  s.add_argument("--preload", action="append", metavar="MODULE",
                 help="with --standby: a module the waiting process imports (repeatable; "
                 "default: JAX only)")
  s.add_argument("--stall-timeout", type=float, metavar="SECONDS",
                 default=stall.DEFAULT_FLOOR_S,
                 help=f"a trainer is stalled after {stall.RULE}. Busy is not hung: one "
                 "whose processes burn CPU is slow (its stacks and the fix, declare the "
                 "phase: ctl.phase), left to work up to "
                 f"{stall.SLOW_MULTIPLE:g}x the timeout; one that burns nothing is hung: "
                 "the launcher prints a \"stall\" line and its Python stacks, kills it and "
                 f"restarts it as a crash (--max-restarts), else ends the job with exit code "
                 f"{stall.EXIT_CODE}; 0: off (default: {stall.DEFAULT_FLOOR_S:g})")
  s.add_argument("--save-grace", type=float, default=launch.DEFAULT_SAVE_GRACE, metavar="S",
                 help="once the trainers are stopped (a signal, the job's end), wait up to S "
                      "seconds for the sidecars to write the steps they accepted before "
                      "stopping them; set it below a scheduler's own kill timeout "
                      f"(default: {launch.DEFAULT_SAVE_GRACE:g})")
  _checkpoint_root_flag(s)
  _log_dir_flag(s)
  s.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                 help="the trainer command, run once per host")
  s.set_defaults(func=_launch, parser=s)

  s = add("status", help="show sidecars' identity, arena use and trainers",
          description="Ask each sidecar for its identity, registry, arena use, a row per "
                      "trainer (its last step, the seconds since, the stall timeout in force, "
                      "its phase), feeds and checkpoint steps, with the token of "
                      "--token-file, $SIDECAR_TOKEN or $SIDECAR_TOKEN_FILE (and TLS where "
                      "$SIDECAR_TLS_CA says so). Exit "
                      "status 1 if any is unreachable.")
  cli_types.add_status_flags(
      s, json_help="print one JSON object with every host, for scripts (default: a table)",
      watch_help="redraw the tables every --interval seconds, with rates, until Ctrl-C "
                 "(default: print once)")
  s.set_defaults(func=_status, parser=s)
  s = add("stalls", help="exit 1 if a trainer of these sidecars is stalled",
          description="Ask each sidecar which of its trainers are stalled (no step for "
                      "their stall timeout: sidecar serve --stall-timeout, docs/elastic.md) "
                      "and print a \"stall\" line for each; exit status 1 if one is hung, "
                      "else 0. Busy is not hung: where one is stalled the sidecars are read "
                      "again half a second later, and one whose process burned CPU meanwhile "
                      "(slow), or that waits for another that did, fails only at "
                      f"{stall.SLOW_MULTIPLE:g}x its timeout (a sidecar that does not answer "
                      "is said, and is no stall). The k8s trainer container's liveness probe "
                      "runs it.")
  cli_types.add_sidecar_flags(s, timeout=5.0)
  s.add_argument("--stacks", action="store_true",
                 help="also send each stalled trainer $SIDECAR_STACKS_SIGNAL (where this "
                      "process may), so its Python stacks go to its stderr (default: off)")
  s.set_defaults(func=_stalls, parser=s)
  pool_status.register(sub)  # sidecar pool status: a shared pool's tenants (docs/pool.md)
  ram_tier_cli.register(sub)  # sidecar ram-tier drop: free RAM-tier copies now
  goodput_cli.register(sub)  # sidecar goodput CKPT_DIR: the job's time ledger

  s = add("demo", help="train a small model fed by a LocalCluster of sidecars",
          description="Train a small classifier on the digits data set, fed and checkpointed "
                      "by a LocalCluster of sidecars on this machine, and print what each "
                      "part cost.")
  s.add_argument("--hosts", type=int, default=2, help="sidecars (simulated hosts)")
  s.add_argument("--devices-per-host", type=int, default=2,
                 help="CPU devices of each host")
  s.add_argument("--steps", type=int, default=300, help="training steps")
  s.add_argument("--processes", type=int, default=1,
                 help="1 (default): one process owns every device; N: the same training as N "
                 "trainer processes under jax.distributed, one per host, via sidecar launch")
  s.add_argument("--elastic", action="store_true",
                 help="train on 3 hosts (or --hosts), SIGKILL one host's sidecar mid-way, and "
                 "go on on the others (sidecar.elastic.retry), with the recovery time "
                 "(default: off)")
  s.add_argument("--torch", action="store_true",
                 help="run examples/torch_train.py instead: PyTorch, DDP on gloo, --hosts ranks "
                 "beside --hosts sidecars (sidecar launch --torch), fed by sidecar.torch."
                 "DataLoader, saved with sidecar.torch.Checkpointer, then resumed by a second "
                 "run (default: off; 60 steps unless --steps)")
  s.add_argument("--verbose", action="store_true",
                 help="show log records, the launcher's lines and the trainers' stderr here "
                      "(default: off: they go to a log file, removed when the run succeeds, "
                      "kept and named when it fails)")
  s.set_defaults(func=_demo)

  s = add("health", help="ask a sidecar's health port whether it serves (exit 0 if so)",
          description="One grpc.health.v1 Check of a sidecar's plaintext health port, as the "
                      "kubelet's probes and the image's HEALTHCHECK ask it: exit status 0 "
                      "when it answers SERVING, 1 otherwise, with what it answered.")
  health_port = _env(env_lib.HEALTH_PORT, str(options_lib.DEFAULT_HEALTH_PORT))
  s.add_argument("address", nargs="?", default=f"127.0.0.1:{health_port}", metavar="ADDR",
                 type=cli_types.address,
                 help="HOST:PORT of the health port, or the unix:PATH a sidecar serves on "
                      "(default: 127.0.0.1:$SIDECAR_HEALTH_PORT, "
                      f"else 127.0.0.1:{options_lib.DEFAULT_HEALTH_PORT})")
  s.add_argument("--timeout", type=float, default=5.0, metavar="S",
                 help="seconds to wait for the answer")
  s.set_defaults(func=_health, parser=s)

  k8s_cli.register(sub)
  slurm_cli.register(sub)
  torchrun.register(sub)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one ``sidecar`` command and returns its exit status.

  A user's mistake the command did not catch itself (a SidecarError or ValueError, e.g.
  ``sidecar demo --hosts 0``) is one line, ``sidecar CMD: MESSAGE``, and exit status 2; its
  traceback goes to the log at DEBUG (``SIDECAR_LOG_LEVEL=DEBUG``). Any other error keeps its
  traceback.
  """
  args = parser().parse_args(argv)
  fmt = getattr(args, "log_format", logs.TEXT)
  logs.configure(fmt, _env(env_lib.LOG_LEVEL, "INFO"),
                 **({"host_id": args.host_id} if fmt == logs.JSON else {}))
  logging.getLogger("jax").setLevel(logging.WARNING)  # "Unable to initialize backend 'tpu'"
  try:
    return args.func(args)
  except (errors.SidecarError, ValueError) as e:
    log.debug("the command ended with this error", exc_info=True)
    words = [args.command, getattr(args, f"{args.command}_command", None)]
    print(f"sidecar {' '.join(w for w in words if w)}: {e}", file=sys.stderr)
    return 2
