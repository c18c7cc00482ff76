"""sidecar.torch.DataLoader against torch.utils.data.DataLoader, over the same elements.

Run from the repository root: ``python -m benchmarks.torch_feed``. Not run by CI.

The elements of benchmarks/feed.py: a 224x224x3 uint8 image, as is ("noop": the
transport's cost) or lightly augmented ("light"); batches of 32 tensors. Rows: (a)
``torch.utils.data.DataLoader(num_workers=2, persistent_workers=True, prefetch_factor=2)``
over a map-style dataset of them, default collate; (b) ``sidecar.torch.DataLoader`` from a
1-host LocalCluster whose sidecar makes the batches with ``workers=2`` straight into its
arena (tensors over it, no copy). Each path warms up first; one process, one rank.
"""

from __future__ import annotations

import argparse
import os
import time

import absl.flags
import torch

import sidecar.torch
from benchmarks import feed_elements
from benchmarks.common import table
from sidecar._src.tools.local import LocalCluster

BATCH = 32
WARMUP_S = 8.0


class Images(torch.utils.data.Dataset):
  def __init__(self, kind: str):
    self.element = feed_elements.element_fn(kind)

  def __len__(self) -> int:
    return feed_elements.N

  def __getitem__(self, i: int):
    return self.element(i)


def consume(iterator, seconds: float) -> tuple[float, float]:
  """Pulls batches for ``seconds`` after a warm-up; returns (batches/s, wait ms per batch)."""
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < WARMUP_S:
    next(iterator)
  n, waited, t0 = 0, 0.0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    w = time.perf_counter()
    batch = next(iterator)
    waited += time.perf_counter() - w
    assert batch["image"].shape == (BATCH, 224, 224, 3)
    n += 1
  return n / (time.perf_counter() - t0), waited / n * 1e3


def epochs(loader):
  """Batches of every epoch in turn, as the sidecar's feed (num_epochs=None) gives them:
  one epoch of feed_elements.N elements lasts only a few seconds."""
  while True:
    yield from loader


def torch_loader(kind: str, seconds: float, workers: int):
  loader = torch.utils.data.DataLoader(Images(kind), batch_size=BATCH, shuffle=True,
                                       num_workers=workers, persistent_workers=True,
                                       prefetch_factor=2)
  it = epochs(loader)
  try:
    return consume(it, seconds)
  finally:
    it.close()
    del it, loader


def sidecar_loader(ctl, kind: str, seconds: float, workers: int, prefetch: int):
  with sidecar.torch.DataLoader("bench_images", BATCH, kwargs={"kind": kind}, workers=workers,
                                prefetch=prefetch, controller=ctl) as loader:
    return consume(iter(loader), seconds)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seconds", type=float, default=6.0)
  ap.add_argument("--workers", type=int, default=2)
  ap.add_argument("--prefetch", type=int, default=4)
  args = ap.parse_args()
  absl.flags.FLAGS.mark_as_parsed()  # Grain's multiprocessing reads absl flags.
  rows = []
  with LocalCluster(1, 1, shm_size="1GiB", imports=["benchmarks.feed_fns"],
                    configure_jax=False) as cluster:
    with sidecar.torch.Controller(cluster.addresses) as ctl:
      for kind in ("noop", "light"):
        base_name = f"(a) torch DataLoader(num_workers={args.workers})"
        results = {
            base_name: torch_loader(kind, args.seconds, args.workers),
            f"(b) sidecar.torch.DataLoader, workers={args.workers}": sidecar_loader(
                ctl, kind, args.seconds, args.workers, args.prefetch),
        }
        base = results[base_name][0]
        for name, (per_s, wait_ms) in results.items():
          rows.append((kind, name, f"{per_s:,.0f}", f"{wait_ms:.2f}", f"{per_s / base:.2f}x"))
  print(table(("elements", "path", "batches/s", "wait ms/batch", "vs (a)"), rows))
  print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
  main()
