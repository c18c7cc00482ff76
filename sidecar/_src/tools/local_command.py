"""``sidecar local``: a LocalCluster until Ctrl-C, and what another shell needs to reach it.

It prints each host's address and worker socket, then a ``SIDECAR_HOSTS=...`` line to
paste as it is: what ``Controller.from_env()`` reads, with each sidecar's health address
(``unix:PATH`` answers both; a TCP entry needs ``HOST:PORT:HEALTH_PORT``, since one without
a health port is checked on 8491). The sidecars' logs are kept in a directory of the run in
``--log-dir`` (``sidecar_logs.py``), and their warnings and errors show on stderr, each
line prefixed ``[sidecar i] ``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time

from sidecar._src.core import env as env_lib, errors
from sidecar._src.tools import sidecar_logs
from sidecar._src.tools.local import LocalCluster

# How long `sidecar local` waits for each sidecar to say how its reload went.
RELOAD_WAIT_S = 30.0
# The lines a sidecar logs for a SIGHUP (serve._reload, Server.reload).
_RELOAD_WORDS = ("got SIGHUP", "reloaded")


def lines(cluster: LocalCluster, *, metrics: bool) -> list[str]:
  """What ``sidecar local`` prints once its sidecars serve, before "Ctrl-C to stop."."""
  n = len(cluster.addresses)
  urls = cluster.metrics_urls if metrics else [""] * n
  out = [f"host {h}: {a}  worker socket unix://{cluster.socket(h)}"
         + (f"  metrics {urls[h]}" if urls[h] else "") for h, a in enumerate(cluster.addresses)]
  entries = ",".join(cluster.host_entry(h) for h in range(n))
  out += [f"SIDECAR_HOSTS={entries}",
          "sidecar logs: " + ", ".join(cluster.log_path(h) for h in range(n))]
  if cluster.pool is not None:
    out += ["every tenant's use (the operator's view, with the pool's operator token): "
            f"sidecar pool status --token-file {shlex.quote(cluster.operator_token_file)} "
            + " ".join(shlex.quote(a) for a in cluster.addresses),
            f"reload {cluster.pool} after editing it: kill -HUP {os.getpid()} (each sidecar's "
            "answer is printed here)"]
  return out


def reload(cluster: LocalCluster, *, wait_s: float = RELOAD_WAIT_S) -> list[str]:
  """SIGHUP to every sidecar; returns what each logged about it (``[host h] LINE``), or
  that it said nothing within ``wait_s``, naming its log."""
  sizes = [_size(cluster.log_path(h)) for h in range(cluster.num_hosts)]
  cluster.reload()
  said: dict[int, str] = {}
  deadline = time.monotonic() + wait_s
  while len(said) < cluster.num_hosts and time.monotonic() < deadline:
    for h in range(cluster.num_hosts):
      if h not in said and (line := _reload_line(cluster.log_path(h), sizes[h])):
        said[h] = line
    time.sleep(0.05)
  return [f"[host {h}] " + said.get(h, f"said nothing about the reload within {wait_s:g} s; "
                                        f"see {cluster.log_path(h)}")
          for h in range(cluster.num_hosts)]


def _warn(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _size(path: str) -> int:
  try:
    return os.path.getsize(path)
  except OSError:
    return 0


def _reload_line(path: str, offset: int) -> str | None:
  """The first line about a reload in ``path`` after ``offset``, whole, or None yet."""
  try:
    with open(path, errors="replace") as f:
      f.seek(offset)
      text = f.read()
  except OSError:
    return None
  for line in text.splitlines(keepends=True):
    if line.endswith("\n") and any(w in line for w in _RELOAD_WORDS):
      return line.strip()
  return None


def run(args: argparse.Namespace) -> int:
  """Serves ``args.hosts`` sidecars until Ctrl-C (or SIGTERM raised as KeyboardInterrupt);
  with a pool file, SIGHUP reloads it on every sidecar and prints what each said."""
  hangups: list[int] = []
  # The token as every command reads it ($SIDECAR_TOKEN, else $SIDECAR_TOKEN_FILE's); a
  # pool file holds its tenants' own.
  try:
    token = None if args.pool else env_lib.token()
  except (OSError, errors.InvalidArgumentError) as e:
    args.parser.error(f"cannot read the token: {e}")
  log_dir = sidecar_logs.run_dir(sidecar_logs.base_dir(args.log_dir))
  cluster = LocalCluster(args.hosts, args.devices_per_host, shm_size=args.shm_size,
                         imports=args.imports or [], configure_jax=False,
                         metrics=args.metrics, checkpoint_roots=args.checkpoint_roots,
                         pool=args.pool, token=token, log_dir=log_dir)
  # The follower ends last: the sidecars' last words at their stop show too.
  with sidecar_logs.Follower({h: cluster.log_path(h) for h in range(args.hosts)}, _warn), \
      cluster:
    if cluster.pool is not None:
      signal.signal(signal.SIGHUP, lambda signum, frame: hangups.append(signum))
    print("\n".join(lines(cluster, metrics=args.metrics)))
    try:  # from the line that tells how to stop it, a stop is a clean exit
      print("Ctrl-C to stop.", flush=True)
      while True:
        signal.pause()
        while hangups:
          hangups.pop()
          print("\n".join(reload(cluster)), flush=True)
    except KeyboardInterrupt:
      pass
  return 0
