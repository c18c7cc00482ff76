"""Tensors and numpy arrays over the same memory, both ways, with no copy.

An arena view (a numpy array that holds its block) becomes a ``torch.Tensor`` by
``torch.from_numpy``: the tensor's storage keeps the array, and so the block, alive
until the tensor and every view of it are freed; then the block goes back. A CPU
tensor's bytes reach the arena through :func:`as_array`, a numpy view of its memory.
Dtypes numpy has no type of its own for (``bfloat16``, the float8 types) go through an
integer type of their size on the torch side and ``ml_dtypes`` on the numpy side, so
their bytes are never converted.
"""

from __future__ import annotations

import numpy as np
import torch

from sidecar._src.core import dtypes as dtypes_lib, errors

# numpy (ml_dtypes) name -> torch dtype, for every dtype both sides have whole bytes of
# (int4 and uint4 pack two elements a byte in torch, one a byte in ml_dtypes).
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in sorted(dtypes_lib.NAMES - {"int4", "uint4"})
    if isinstance(getattr(torch, name, None), torch.dtype)}
NAMES: dict[torch.dtype, str] = {t: n for n, t in TORCH_DTYPES.items()}
# Moved as integers of their size: numpy cannot hand torch these types directly.
_BITS = {"bfloat16": (torch.int16, np.dtype(np.int16)),
         "float8_e4m3fn": (torch.uint8, np.dtype(np.uint8)),
         "float8_e5m2": (torch.uint8, np.dtype(np.uint8))}


def dtype_name(dtype: torch.dtype, where: str = "tensor") -> str:
  """The numpy (ml_dtypes) name of a torch dtype; InvalidArgumentError if none."""
  name = NAMES.get(dtype)
  if name is None:
    raise errors.InvalidArgumentError(
        f"{where}: dtype {dtype} cannot go through the sidecar; supported: "
        f"{', '.join(str(t) for t in NAMES)}")
  return name


def torch_dtype(name: str, where: str = "array") -> torch.dtype:
  """The torch dtype of a numpy (ml_dtypes) dtype name."""
  dtype = TORCH_DTYPES.get(name)
  if dtype is None:
    raise errors.InvalidArgumentError(
        f"{where}: dtype {name!r} has no torch dtype; supported: {', '.join(TORCH_DTYPES)}")
  return dtype


def from_array(array: np.ndarray) -> torch.Tensor:
  """A tensor over ``array``'s memory (no copy); it holds ``array`` until it is freed."""
  name = array.dtype.name
  if name in _BITS:
    return torch.from_numpy(array.view(_BITS[name][1])).view(TORCH_DTYPES[name])
  torch_dtype(name)
  return torch.from_numpy(array)


def as_array(tensor: torch.Tensor, where: str = "tensor") -> np.ndarray:
  """A numpy view of a CPU, contiguous tensor's memory (no copy).

  Raises:
    InvalidArgumentError: the tensor is on another device, not contiguous, or of a dtype
      the sidecar does not carry; the message names ``where``.
  """
  if tensor.device.type != "cpu":
    raise errors.InvalidArgumentError(f"{where} is on {tensor.device}, not the CPU")
  if not tensor.is_contiguous():
    raise errors.InvalidArgumentError(f"{where} is not contiguous")
  name = dtype_name(tensor.dtype, where)
  t = tensor.detach()
  if name in _BITS:
    return t.view(_BITS[name][0]).numpy().view(dtypes_lib.dtype_of(name))
  return t.numpy()

