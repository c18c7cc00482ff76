"""The dtypes that travel and are checkpointed, by name: numpy's and ``ml_dtypes``'.

One table for every layer: the codec (what a call, a stream or a shard may carry),
the checkpoint formats (what a leaf spec names) and the framework adapters. Unlike
the other leaves of ``core`` it needs numpy and ``ml_dtypes`` (for ``bfloat16`` and
the float8/int4 types), never a framework.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from sidecar._src.core import errors

_DTYPES: dict[str, np.dtype] = {
    np.dtype(t).name: np.dtype(t) for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
        ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
        ml_dtypes.int4, ml_dtypes.uint4)
}
NAMES = frozenset(_DTYPES)


def dtype_of(name: str, where: str = "array") -> np.dtype:
  """The allowed dtype called ``name``, or InvalidArgumentError."""
  dtype = _DTYPES.get(name)
  if dtype is None:
    raise errors.InvalidArgumentError(
        f"{where}: dtype {name!r} is not allowed; allowed dtypes: {', '.join(sorted(_DTYPES))}")
  return dtype
