"""Functions and pipelines the notebook tests register (``--import tests.support.notebook_fns``).

Each is slow on purpose, so that a cell can be interrupted while it runs.
"""

import time

import grain
import numpy as np

import sidecar


@sidecar.function
def slow_block(nbytes: int, seconds: float) -> np.ndarray:
  """An arena-sized result that takes ``seconds`` to make."""
  time.sleep(seconds)
  return np.full((nbytes,), 7, np.uint8)


@sidecar.function
def slow_items(nbytes: int, seconds: float, n: int = 1000):
  """Items of ``nbytes`` each (through the arena), one per ``seconds``."""
  for i in range(n):
    time.sleep(seconds)
    yield np.full((nbytes,), i % 251, np.uint8)


@sidecar.pipeline
def slow_rows(ctx: sidecar.PipelineContext, width: int = 1024, seconds: float = 0.0,
              first_s: float = 0.0, slow_shard: int = -1):
  """Row ``i`` is ``[i] * width``; each row takes ``seconds`` (on shard ``slow_shard`` only,
  if given), the first row ``first_s`` more."""
  delay = seconds if slow_shard in (-1, ctx.shard_index) else 0.0
  first = [first_s]

  def element(i):
    time.sleep(delay + first[0])
    first[0] = 0.0
    return {"x": np.full((width,), i, np.float32)}
  return grain.MapDataset.range(1 << 20).map(element)
