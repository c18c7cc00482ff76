"""Sidecar-side helpers of ``benchmarks.checkpoint`` (``--import benchmarks.checkpoint_fns``)."""

import pathlib
import time

import sidecar
from sidecar._src.ckptfmt import records, spec as spec_lib
from sidecar._src.ckptfmt.orbax import read as orbax_read


@sidecar.function
def read_phases(directory: str, step: int, names: list[str], shape: list[int]
                ) -> dict[str, float]:
  """What a restore from storage costs in this process, leaf by leaf, as the ``Checkpoint.Read``
  rpc does it.

  Returns seconds summed over the leaves (each of ``shape``, one chunk): ``read``, from its
  chunk file into a new arena block, and ``crc32c``.
  """
  out = {"read": 0.0, "crc32c": 0.0}
  item = pathlib.Path(directory) / str(step) / spec_lib.ITEM
  index = tuple((0, n) for n in shape)
  for name in names:
    t0 = time.perf_counter()
    data = orbax_read.read_item_shard(item, (name,), index, allocate=sidecar.empty)
    t1 = time.perf_counter()
    records.shard_crc32c(data)
    out["read"] += t1 - t0
    out["crc32c"] += time.perf_counter() - t1
  return out
