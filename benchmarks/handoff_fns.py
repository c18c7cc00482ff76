"""Sidecar-side functions of the benchmarks (``--import benchmarks.handoff_fns``)."""

import numpy as np

import sidecar

_cache: dict[int, np.ndarray] = {}


@sidecar.function
def source(nbytes: int) -> np.ndarray:
  """A batch that already sits in the sidecar's memory, as a pipeline's output would."""
  a = _cache.get(nbytes)
  if a is None:
    a = _cache[nbytes] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
  return a


@sidecar.function
def source_stream(nbytes: int):
  """The same batch, over and over, as a pipeline's output stream."""
  a = source(nbytes)
  while True:
    yield a


@sidecar.function
def made_in_arena(nbytes: int):
  """Batches a producer writes straight into the arena (sidecar.empty), as feeds do.

  They are not filled here: what is left to measure is the handoff alone.
  """
  while True:
    yield sidecar.empty((nbytes,), np.uint8)


@sidecar.function
def noop() -> None:
  return None
