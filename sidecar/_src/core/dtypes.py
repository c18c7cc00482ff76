"""The dtypes that travel and are checkpointed, by name: numpy's and ``ml_dtypes``'.

One table for every layer: the codec (what a call, a stream or a shard may carry),
the checkpoint formats (what a leaf spec names) and the framework adapters. Unlike
the other leaves of ``core`` it needs numpy and ``ml_dtypes`` (for ``bfloat16`` and
the float8/int4 types), never a framework.
"""

from __future__ import annotations

import numpy as np

from sidecar._src.core import errors

_DTYPES: dict[str, np.dtype] = {
    np.dtype(t).name: np.dtype(t) for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128)
}
# ml_dtypes' types, imported at the first use of one: its import costs a sidecar more than
# the rest of its start (about 0.5 s of CPU; several seconds on a loaded machine).
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4")
NAMES = frozenset(_DTYPES) | frozenset(_ML_DTYPES)


def _ml_dtype(name: str) -> np.dtype:
  import ml_dtypes
  dtype = _DTYPES[name] = np.dtype(getattr(ml_dtypes, name))
  return dtype


def dtype_of(name: str, where: str = "array") -> np.dtype:
  """The allowed dtype called ``name``, or InvalidArgumentError."""
  dtype = _DTYPES.get(name)
  if dtype is None and name in _ML_DTYPES:
    dtype = _ml_dtype(name)
  if dtype is None:
    raise errors.InvalidArgumentError(
        f"{where}: dtype {name!r} is not allowed; allowed dtypes: {', '.join(sorted(NAMES))}")
  return dtype


_NAMES: dict[np.dtype, str] = {}  # grows by the few dtypes a process meets


def name_of(dtype: np.dtype) -> str:
  """``dtype.name``, remembered: numpy works the name out in Python at each ask (~5-13 us,
  more than the rest of a feed batch's descriptor), and a feed asks it for every block of
  every batch."""
  name = _NAMES.get(dtype)
  if name is None:
    name = _NAMES[dtype] = dtype.name
  return name
