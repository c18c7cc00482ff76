"""The user code of the pod test's sidecar (`SIDECAR_IMPORTS=pod_fns`, mounted read-only)."""

import grain
import numpy as np

import sidecar


@sidecar.pipeline
def counting(ctx: sidecar.PipelineContext, *, n: int = 1_000_000):
  """Element i is {"x": [i, i, ...] (16 float32), "i": i}: a batch says which rows it holds."""
  return grain.MapDataset.range(n).map(
      lambda i: {"x": np.full((16,), i, np.float32), "i": np.int64(i)})


@sidecar.function
def where() -> dict:
  """What the sidecar container sees of itself, to compare with the trainer's."""
  import os
  return {"ipc": os.readlink("/proc/self/ns/ipc"), "uid": os.getuid(), "gid": os.getgid()}
