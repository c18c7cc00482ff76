"""A pipeline whose batches after the first few are slow to make: its producer is busy
while its trainer takes what came ahead, so the trainer's credits wait unread on the
stream's connection (tests/processes/server/test_session_end.py)."""

import time

import numpy as np

import sidecar


@sidecar.pipeline
def slow_after(ctx: sidecar.PipelineContext, fast: int = 6, delay: float = 0.5):
  def batches():
    i = 0
    while True:
      if i >= fast:
        time.sleep(delay)
      yield {"x": np.full((4096,), i, np.float32)}
      i += 1
  return batches()


def _slow_element(fast: int, delay: float):
  def element(i):
    if i >= fast:
      time.sleep(delay)
    return {"x": np.full((4096,), i, np.float32)}
  return element


@sidecar.pipeline
def slow_map(ctx: sidecar.PipelineContext, fast: int = 6, delay: float = 0.2):
  """``slow_after`` with random access: what feed worker processes (``workers=N``) fill; a
  batch in the making when its feed ends is done well within the workers' grace
  (``processes.STOP_GRACE``), so each answers a feed that is gone."""
  import grain
  return grain.MapDataset.range(1 << 20).map(_slow_element(fast, delay))
