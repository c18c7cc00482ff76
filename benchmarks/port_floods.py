"""Floods of a sidecar's ports without a token (issue 76), against its default bounds: what
a new client with the token and the kubelet's health checks get meanwhile.

Run it against two trees for a before/after table (the same script, either code)::

  PYTHONPATH=/path/to/old/tree python -m benchmarks.port_floods
  PYTHONPATH=. python -m benchmarks.port_floods [--seconds 8]

Each flood runs in a process of its own (``--attack KIND``), from another loopback peer
(127.0.0.2), against a fresh 1-host ``LocalCluster`` over TCP with a token:

- ``idle``: 2,048 HTTP/2 connections that said their preface and nothing more;
- ``reopen``: the same, each one the sidecar closes opened again at once (as fast as this
  process can: the flood that outlasts any idle bound);
- ``watch``: 64 connections holding a health ``Watch`` stream each;
- ``half-open``: one connection, 64 calls whose request never comes.

Meanwhile, for ``--seconds``: a new client (a channel of its own) handshakes and asks
Status (5 s deadline), and a health check as the kubelet makes it (1 s deadline),
alternately. Printed: how many of each got through, and the new clients' median time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import sidecar
from benchmarks.common import table
from sidecar._src.wire import protocol
from tests.support import h2_flood

TOKEN = "bench-token-0123456789abcdef"
ATTACKS = {"none": "no flood", "idle": "2,048 idle connections",
           "reopen": "2,048 idle connections, reopened as closed",
           "watch": "64 health Watch streams", "half-open": "64 half-open calls, 1 connection"}


def attack(kind: str, port: int, health_port: int) -> None:
  """The flood ``kind``, until this process is killed; says "ready" once it holds it."""
  if kind == "idle":
    held = h2_flood.idle(port, 2048)
  elif kind == "watch":
    held = h2_flood.watches(health_port, 64)
  elif kind == "half-open":
    sock = h2_flood.connect(port)
    h2_flood.half_open(sock, f"/{protocol.SERVICE}/Status", 64)
    held = [sock]
  else:
    held = h2_flood.idle(port, 2048)
  print("ready", flush=True)
  while kind == "reopen":
    kept = [c for c in held if h2_flood.open_count([c])]
    h2_flood.close([c for c in held if c not in kept])
    held = kept + h2_flood.idle(port, 2048 - len(kept))
    time.sleep(0.01)
  time.sleep(3600)


def measure(cluster, seconds: float) -> tuple[str, str]:
  """New clients and health checks, alternately, for ``seconds``."""
  health = int(cluster.health_addresses[0].rsplit(":", 1)[1])
  clients, checks = [], []
  end = time.monotonic() + seconds
  while time.monotonic() < end:
    t0 = time.monotonic()
    try:
      ok = h2_flood.new_client(cluster.addresses[0], TOKEN, timeout=5)
    except Exception:  # noqa: BLE001  (refused, timed out: counted as not through)
      ok = False
    clients.append((ok, time.monotonic() - t0))
    checks.append(h2_flood.check(health, timeout=1) == "SERVING")
  through = [t for ok, t in clients if ok]
  median = f"{statistics.median(through):.2f} s" if through else "-"
  return (f"{len(through)}/{len(clients)} (median {median})",
          f"{sum(checks)}/{len(checks)}")


def run(kind: str, seconds: float) -> tuple[str, str]:
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    configure_jax=False, transport="tcp",
                                    token=TOKEN) as cluster:
    if kind == "none":
      return measure(cluster, seconds)
    port = cluster.addresses[0].rsplit(":", 1)[1]
    health = cluster.health_addresses[0].rsplit(":", 1)[1]
    flood = subprocess.Popen([sys.executable, "-m", "benchmarks.port_floods", "--attack", kind,
                              port, health], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ))
    try:
      assert flood.stdout is not None
      if flood.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {kind} flood did not start")
      return measure(cluster, seconds)
    finally:
      flood.kill()
      flood.wait()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seconds", type=float, default=8.0)
  ap.add_argument("--attack", nargs=3, metavar=("KIND", "PORT", "HEALTH_PORT"))
  ap.add_argument("--only", choices=sorted(ATTACKS), action="append")
  args = ap.parse_args()
  if args.attack:
    kind, port, health = args.attack
    return attack(kind, int(port), int(health))
  rows = []
  for kind in args.only or ATTACKS:
    rows.append((ATTACKS[kind], *run(kind, args.seconds)))
    print(table(("flood (no token, from 127.0.0.2)", "new clients through (5 s deadline)",
                 "health checks SERVING (1 s deadline)"), rows[-1:]), flush=True)
  print(f"\n## floods of the control and health ports, {args.seconds:g} s each\n")
  print(table(("flood (no token, from 127.0.0.2)", "new clients through (5 s deadline)",
               "health checks SERVING (1 s deadline)"), rows))


if __name__ == "__main__":
  with contextlib.suppress(KeyboardInterrupt):
    main()
