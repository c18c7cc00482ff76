"""Sidecar-side functions of ``benchmarks.soak`` (``--import benchmarks.soak_fns``)."""

import grain
import numpy as np

import sidecar


@sidecar.function
def echo(x):
  return x


@sidecar.pipeline
def soak_rows(ctx: sidecar.PipelineContext, n: int = 100_000):
  """Example i: its id and a 4 KiB row."""
  return grain.MapDataset.range(n).map(
      lambda i: {"id": np.int64(i), "x": np.full((1024,), i, np.float32)})


@sidecar.function
def echo_items_forever():
  """Yields 1 for ever: a stream that runs as far ahead as its credits allow."""
  while True:
    yield 1
