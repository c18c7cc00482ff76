"""What the quick start's sidecars register (``imports=["quickstart_fns"]``)."""

import grain
import numpy as np

import sidecar


@sidecar.function
def normalize(x: np.ndarray) -> np.ndarray:  # runs in the sidecar, by name
  return (x - x.mean()) / x.std()


@sidecar.pipeline
def images(ctx: sidecar.PipelineContext, *, n: int = 10_000):
  # A grain.MapDataset: the framework shards, shuffles and positions it globally.
  return grain.MapDataset.range(n).map(
      lambda i: {"image": np.full((32, 32, 3), i % 256, np.uint8), "label": np.int32(i % 10)})
