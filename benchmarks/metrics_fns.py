"""What the metrics benchmark's sidecars run (``--import benchmarks.metrics_fns``)."""

import grain
import numpy as np

import sidecar


@sidecar.function
def bench_echo(x):
  return x


@sidecar.pipeline
def bench_small(ctx: sidecar.PipelineContext, width: int = 64):
  """Small elements, so a batch costs its transport more than its bytes."""
  row = np.arange(width, dtype=np.float32)
  return grain.MapDataset.range(1 << 20).map(lambda i: {"x": row, "id": np.int64(i)})
