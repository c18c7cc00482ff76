"""The pipeline ``benchmarks.goodput_overhead`` feeds from: tiny rows, so a batch costs
little more than the feed's own path."""

import grain
import numpy as np

import sidecar


@sidecar.pipeline
def ids(ctx: sidecar.PipelineContext, n: int = 1000):
  return grain.MapDataset.range(n).map(lambda i: {"x": np.full((4,), i, np.float32)})
