"""``sidecar.empty``: results made in place in the arena, sent without a copy.

Inside a registered function (or while a stream's iterable runs), ``empty`` hands
out arrays that live in the sidecar's arena; returning or yielding one sends only
its descriptor, so the bytes reach the worker's ``jax.Array`` without any copy.
Elsewhere (a test calling the function directly, say) it is ``np.empty``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

Allocate = Callable[[tuple[int, ...], np.dtype], np.ndarray]
_allocate: contextvars.ContextVar[Allocate | None] = contextvars.ContextVar(
    "sidecar_allocate", default=None)


def empty(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
  """An uninitialized array; in the arena when called inside the sidecar.

  Example::

    @sidecar.function
    def decode(blob: bytes) -> np.ndarray:
      out = sidecar.empty((32, 224, 224, 3), np.uint8)
      my_decoder.decode_into(blob, out)   # the result is written where it will be read
      return out                          # only a descriptor crosses
  """
  shape = (shape,) if isinstance(shape, int) else tuple(shape)
  allocate = _allocate.get()
  if allocate is None:
    return np.empty(shape, dtype)
  return allocate(shape, np.dtype(dtype))


@contextlib.contextmanager
def allocating(allocate: Allocate) -> Iterator[None]:
  """Makes ``empty`` allocate with ``allocate`` in this context."""
  token = _allocate.set(allocate)
  try:
    yield
  finally:
    _allocate.reset(token)
