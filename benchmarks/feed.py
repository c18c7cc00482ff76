"""Delivering the same Grain pipeline to a consumer that makes jax.Arrays, three ways.

Run from the repository root: ``python -m benchmarks.feed``. Not run by CI.

Per element: a 224x224x3 uint8 image, either as is ("noop": exposes transport cost)
or lightly augmented ("light"); batch 32. Rows: (a) Grain in-process
(``to_iter_dataset``), (b) Grain ``mp_prefetch`` with 2 workers, (c) ``ctl.feed`` on
a 1-host LocalCluster with ``workers=2``. Reports batches/s, the trainer's wait per
step, and ratios against (b); for Grain also batches/s when the consumer keeps numpy
arrays (no jax.Array). Each path warms up for WARMUP_S seconds first.
"""

from __future__ import annotations

import argparse
import time

import absl.flags
import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from benchmarks import feed_fns
from benchmarks.common import table

BATCH = 32


WARMUP_S = 12.0  # Grain mp_prefetch needs ~8 s here to reach its steady rate: warm every path up.


def consume(iterator, *, seconds: float, to_jax: bool = True) -> tuple[float, float]:
  """Pulls batches (into jax.Arrays) for ``seconds``; returns (batches/s, mean wait ms)."""
  device = jax.devices()[0]
  put = (lambda b: jax.block_until_ready(jax.device_put(b, device))) if to_jax else (
      lambda b: b)
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < WARMUP_S:
    put(next(iterator))
  n, waited, t0 = 0, 0.0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    w = time.perf_counter()
    batch = next(iterator)
    waited += time.perf_counter() - w
    put(batch)
    n += 1
  return n / (time.perf_counter() - t0), waited / n * 1e3


def grain_inprocess(kind: str, seconds: float, to_jax: bool = True):
  return consume(iter(feed_fns.dataset(kind).repeat().batch(BATCH).to_iter_dataset()),
                 seconds=seconds, to_jax=to_jax)


def grain_mp(kind: str, seconds: float, workers: int, to_jax: bool = True):
  ds = feed_fns.dataset(kind).repeat().batch(BATCH).to_iter_dataset().mp_prefetch(
      grain.MultiprocessingOptions(num_workers=workers))
  it = iter(ds)
  try:
    return consume(it, seconds=seconds, to_jax=to_jax)
  finally:
    del it


def sidecar_feed(ctl, kind: str, seconds: float, workers: int, prefetch: int):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with ctl.feed("bench_images", kwargs={"kind": kind}, global_batch_size=BATCH, sharding=sharding,
                options=sidecar.FeedOptions(workers=workers, prefetch=prefetch)) as feed:
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
        mp = f"(b) Grain mp_prefetch({args.workers})"
        results = {
            "(a) Grain in-process": grain_inprocess(kind, args.seconds),
            mp: grain_mp(kind, args.seconds, args.workers),
            f"(c) ctl.feed, workers={args.workers}": sidecar_feed(
                ctl, kind, args.seconds, args.workers, args.prefetch),
        }
        numpy_only = {"(a) Grain in-process": grain_inprocess(kind, args.seconds, False)[0],
                      mp: grain_mp(kind, args.seconds, args.workers, False)[0]}
        base = results[mp][0]
        for name, (per_s, wait_ms) in results.items():
          bare = numpy_only.get(name)
          rows.append((kind, name, f"{per_s:,.0f}", f"{wait_ms:.2f}", f"{per_s / base:.2f}x",
                       "-" if bare is None else f"{bare:,.0f}"))
  print(table(("elements", "path", "batches/s into jax.Array", "wait ms/step", "vs (b)",
               "batches/s, numpy only"), rows))


if __name__ == "__main__":
  main()
