"""Sidecar-side helpers of ``benchmarks.checkpoint`` (``--import benchmarks.checkpoint_fns``)."""

import pathlib
import time

import numpy as np

import sidecar
from sidecar._src import orbax_layout as ol

@sidecar.function
def read_phases(directory: str, step: int, names: list[str]) -> dict[str, float]:
  """What a restore from storage costs in this process, leaf by leaf, as ``sidecar.ckpt.read``
  does it.

  Returns seconds summed over the leaves: ``read`` (TensorStore), ``crc32c``, and
  ``copy`` into untouched pages, as a result is copied into a fresh arena's blocks.
  """
  out = {"read": 0.0, "crc32c": 0.0, "copy": 0.0}
  for name in names:
    t0 = time.perf_counter()
    data = ol.read_item_leaf(pathlib.Path(directory) / str(step) / ol.ITEM, (name,))
    t1 = time.perf_counter()
    ol.shard_crc32c(data)
    t2 = time.perf_counter()
    np.copyto(np.empty_like(data), data)
    out["read"] += t1 - t0
    out["crc32c"] += t2 - t1
    out["copy"] += time.perf_counter() - t2
  return out
