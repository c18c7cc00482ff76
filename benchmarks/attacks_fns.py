"""Sidecar-side functions of ``benchmarks.attacks`` (``--import benchmarks.attacks_fns``)."""

import threading
import time

import numpy as np

import sidecar

_lock = threading.Lock()
_pulled = [0]


@sidecar.function
def nap(seconds: float) -> float:
  """A slow call: holds its server thread for ``seconds``."""
  time.sleep(seconds)
  return seconds


@sidecar.pipeline
def huge_rows(ctx: sidecar.PipelineContext, nbytes: int = 1 << 20):
  """A plain iterable of ``nbytes`` elements (touched, so they count in RSS), counted."""
  while True:
    with _lock:
      _pulled[0] += 1
    yield {"x": np.ones((nbytes,), np.uint8)}


@sidecar.function
def pulled() -> int:
  """How many elements ``huge_rows`` yielded in this sidecar."""
  with _lock:
    return _pulled[0]


@sidecar.function
def size_of(a) -> int:
  """The bytes of ``a``: a call whose cost is its argument's decoding alone."""
  return int(np.asarray(a).nbytes)


@sidecar.function
def big_items(n: int, nbytes: int):
  """``n`` items of ``nbytes`` each: through the arena to an attached consumer."""
  for i in range(n):
    yield np.full((nbytes,), i % 251, np.uint8)
