"""``sidecar local``: a LocalCluster until Ctrl-C, and what another shell needs to reach it.

It prints each host's address and worker socket, then a ``SIDECAR_HOSTS=...`` line to
paste as it is: what ``Controller.from_env()`` reads, with each sidecar's health address
(``unix:PATH`` answers both; a TCP entry needs ``HOST:PORT:HEALTH_PORT``, since one without
a health port is checked on 8491).
"""

from __future__ import annotations

import argparse
import signal

from sidecar._src.tools.local import LocalCluster


def lines(cluster: LocalCluster, *, metrics: bool) -> list[str]:
  """What ``sidecar local`` prints once its sidecars serve, before "Ctrl-C to stop."."""
  urls = cluster.metrics_urls if metrics else [""] * len(cluster.addresses)
  out = [f"host {h}: {a}  worker socket unix://{cluster.socket(h)}"
         + (f"  metrics {urls[h]}" if urls[h] else "") for h, a in enumerate(cluster.addresses)]
  entries = ",".join(cluster.host_entry(h) for h in range(len(cluster.addresses)))
  return [*out, f"SIDECAR_HOSTS={entries}"]


def run(args: argparse.Namespace) -> int:
  """Serves ``args.hosts`` sidecars until Ctrl-C (or SIGTERM raised as KeyboardInterrupt)."""
  with LocalCluster(args.hosts, args.devices_per_host, shm_size=args.shm_size,
                    imports=args.imports or [], configure_jax=False,
                    metrics=args.metrics, checkpoint_roots=args.checkpoint_roots,
                    pool=args.pool) as cluster:
    print("\n".join(lines(cluster, metrics=args.metrics)))
    try:  # from the line that tells how to stop it, a stop is a clean exit
      print("Ctrl-C to stop.", flush=True)
      while True:
        signal.pause()
    except KeyboardInterrupt:
      pass
  return 0
