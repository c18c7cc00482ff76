"""Registered code that needs no framework: what a lean sidecar serves
(``--import tests.support.lean_fns``; tests/processes/tools/test_lean_sidecar.py)."""

import sys

import numpy as np

import sidecar

FRAMEWORKS = ("grain", "jax", "jaxlib", "orbax", "tensorstore", "torch")


@sidecar.function
def frameworks_loaded() -> list[str]:
  """The frameworks this sidecar process has imported so far."""
  return [m for m in FRAMEWORKS if m in sys.modules]


@sidecar.function
def scale(x: np.ndarray, factor: float = 2.0) -> np.ndarray:
  return x * factor


@sidecar.function
def load_jax() -> str:
  """Imports jax, as a registered function that needs it does."""
  import jax
  return jax.__version__


@sidecar.function
def arrays(n: int, nbytes: int):
  """Items for ``ctl.stream``: arrays big enough to travel through the arena."""
  for i in range(n):
    yield np.full((nbytes,), i, np.uint8)
