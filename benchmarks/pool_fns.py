"""The registered code of ``benchmarks.pool``: one pipeline every tenant feeds from, and
the functions its inline-call figures call (the sidecar imports this module)."""

import grain
import numpy as np

import sidecar

WIDTH = 4096  # float32: 16 KiB a row


@sidecar.pipeline
def rows(ctx: sidecar.PipelineContext, n: int = 1 << 30):
  """Row i is ``{"x": [i] * WIDTH}``: cheap to make, so the pool's sharing is measured."""
  del ctx
  return grain.MapDataset.range(n).map(lambda i: {"x": np.full((WIDTH,), i, np.float32)})


@sidecar.function
def size_of(a) -> int:
  """The bytes of ``a``: a call that costs what decoding its argument costs."""
  return int(np.asarray(a).nbytes)


@sidecar.function
def echo(x):
  """``x`` back: its argument decoded, its result encoded."""
  return x
