"""What tests/accelerator registers in its sidecars (``--import tests.support.accelerator_fns``).

A sidecar and its feed workers must run JAX on the CPU: only one process may open a TPU,
and the trainer's is that one. ``jax_platform`` and the ``platforms`` pipeline ask JAX in
the sidecar and in each feed worker which platform it got.
"""

import os

import grain
import numpy as np

import sidecar

ROW = (224, 224, 3)  # an image row: 32 of them make the 4.8 MB batch of the benchmarks


def row(i: int) -> np.ndarray:
  """Row ``i``'s image: random bytes seeded by ``i``, so a byte of another row (a block
  reused while its copy to the device was in flight) shows."""
  return np.random.default_rng(int(i)).integers(0, 256, ROW, dtype=np.uint8)


@sidecar.pipeline
def known_rows(ctx: sidecar.PipelineContext, n: int = 1024):
  """Element ``i`` is ``{"id": i, "image": row(i)}``: the trainer can check every row."""
  return grain.MapDataset.range(n).map(lambda i: {"id": np.int64(i), "image": row(i)})


def _platform() -> dict[str, str]:
  import jax  # here, in the process that asks: the import alone opens no device
  return {"platform": jax.devices()[0].platform,
          "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "(unset)")}


@sidecar.function
def jax_platform() -> dict[str, str]:
  """The platform JAX gives this sidecar (opening it, as a registered function may),
  and its JAX_PLATFORMS."""
  return _platform()


@sidecar.pipeline
def platforms(ctx: sidecar.PipelineContext, n: int = 256):
  """Element ``i``: ``cpu`` 1 where the process that made it runs JAX on the CPU with
  JAX_PLATFORMS=cpu (a feed worker, or the sidecar), else 0; and that process's pid."""
  def element(i):
    seen = _platform()
    on_cpu = seen == {"platform": "cpu", "JAX_PLATFORMS": "cpu"}
    return {"cpu": np.int8(on_cpu), "pid": np.int64(os.getpid())}
  return grain.MapDataset.range(n).map(element)
