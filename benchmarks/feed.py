"""Delivering the same Grain pipeline to a consumer that makes jax.Arrays, three ways.

Run from the repository root: ``python -m benchmarks.feed``. Not run by CI.

Per element: a 224x224x3 uint8 image, either as is ("noop": exposes transport cost)
or lightly augmented ("light"); batch 32. Rows: (a) Grain in-process
(``to_iter_dataset``), (b) Grain ``mp_prefetch`` with 2 workers, (c) ``ctl.feed`` on
a 1-host LocalCluster with ``workers=2``. Reports batches/s, the trainer's wait per
step, and ratios against (b).
"""

from __future__ import annotations

import argparse
import time

import absl.flags
import grain
import jax
import numpy as np
from jax.sharding import NamedSharding, Mesh, PartitionSpec as P

import sidecar
from benchmarks import feed_fns
from benchmarks.common import table

BATCH = 32


def consume(iterator, *, seconds: float, warmup: int = 5) -> tuple[float, float]:
  """Pulls batches into jax.Arrays for ``seconds``; returns (batches/s, mean wait ms)."""
  device = jax.devices()[0]
  for _ in range(warmup):
    jax.block_until_ready(jax.device_put(next(iterator), device))
  n, waited, t0 = 0, 0.0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    w = time.perf_counter()
    batch = next(iterator)
    waited += time.perf_counter() - w
    jax.block_until_ready(jax.device_put(batch, device))
    n += 1
  return n / (time.perf_counter() - t0), waited / n * 1e3


def grain_inprocess(kind: str, seconds: float):
  return consume(iter(feed_fns.dataset(kind).batch(BATCH).to_iter_dataset()), seconds=seconds)


def grain_mp(kind: str, seconds: float, workers: int):
  ds = feed_fns.dataset(kind).batch(BATCH).to_iter_dataset().mp_prefetch(
      grain.MultiprocessingOptions(num_workers=workers))
  it = iter(ds)
  try:
    return consume(it, seconds=seconds)
  finally:
    del it


def sidecar_feed(ctl, kind: str, seconds: float, workers: int, prefetch: int):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with ctl.feed("bench_images", global_batch_size=BATCH, sharding=sharding, workers=workers,
                prefetch=prefetch, kind=kind) as feed:
    return consume(feed, seconds=seconds)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seconds", type=float, default=4.0)
  ap.add_argument("--workers", type=int, default=2)
  ap.add_argument("--prefetch", type=int, default=4)
  args = ap.parse_args()
  absl.flags.FLAGS.mark_as_parsed()  # Grain's multiprocessing reads absl flags.
  rows = []
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="1GiB",
                                    imports=["benchmarks.feed_fns"]) as cluster:
    with cluster.controller() as ctl:
      for kind in ("noop", "light"):
        results = {
            "(a) Grain in-process": grain_inprocess(kind, args.seconds),
            f"(b) Grain mp_prefetch({args.workers})": grain_mp(kind, args.seconds, args.workers),
            f"(c) ctl.feed, workers={args.workers}": sidecar_feed(
                ctl, kind, args.seconds, args.workers, args.prefetch),
        }
        base = results[f"(b) Grain mp_prefetch({args.workers})"][0]
        for name, (per_s, wait_ms) in results.items():
          rows.append((kind, name, f"{per_s:,.0f}", f"{wait_ms:.2f}", f"{per_s / base:.2f}x"))
  print(table(("elements", "path", "batches/s", "wait ms/step", "vs (b)"), rows))


if __name__ == "__main__":
  main()
