"""Tier 1: arena-style numpy views become tensors with no copy, and tensors numpy views."""

import gc
import mmap
import weakref

import ml_dtypes
import numpy as np
import pytest
import torch

from sidecar._src.core import errors
from sidecar._src.torch import tensors

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "bool", "bfloat16",
                                   "float16", "float8_e4m3fn", "complex64"])
def test_a_view_becomes_a_tensor_over_the_same_memory_and_back(dtype):
  np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
  buf = np.frombuffer(mmap.mmap(-1, 4096), np.uint8)  # page-aligned, as an arena block
  a = buf[:6 * np_dtype.itemsize].view(np_dtype).reshape(2, 3)
  t = tensors.from_array(a)
  assert t.dtype == getattr(torch, dtype) and tuple(t.shape) == (2, 3)
  assert t.data_ptr() == a.ctypes.data  # no copy
  back = tensors.as_array(t)
  assert back.dtype == np_dtype and back.ctypes.data == a.ctypes.data


def test_the_tensor_holds_its_array_until_it_is_freed():
  class Block(np.ndarray):  # stands for an arena view, whose lifetime holds its block
    pass
  a = np.zeros(16, np.float32).view(Block)
  alive = weakref.ref(a)
  gc.disable()
  try:
    t = tensors.from_array(a)[2:5]  # a view of the tensor keeps it too
    del a
    assert alive() is not None
    del t
    assert alive() is None  # at the last reference, with no collector
  finally:
    gc.enable()


def test_tensors_the_sidecar_cannot_take_are_named():
  with pytest.raises(errors.InvalidArgumentError, match="opt.m is not contiguous"):
    tensors.as_array(torch.zeros(4, 4).t(), "opt.m")
  with pytest.raises(errors.InvalidArgumentError, match="dtype torch.float8_e4m3fnuz cannot go"):
    tensors.as_array(torch.zeros(2, dtype=torch.float8_e4m3fnuz), "z")
  with pytest.raises(errors.InvalidArgumentError, match="has no torch dtype"):
    tensors.torch_dtype("int4")


def test_a_state_dict_entry_off_the_cpu_or_strided_is_copied_and_one_with_no_data_named():
  from sidecar._src.torch import framework
  t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
  a = framework.numpy_array(t.t(), "state dict entry 'w'")  # a transposed view: copied
  assert a.flags.c_contiguous and a.tolist() == t.t().tolist()
  assert framework.numpy_array(t, "x").ctypes.data == t.data_ptr()  # as it is: no copy
  with pytest.raises(errors.InvalidArgumentError,
                     match="state dict entry 'model.w' is on the meta device.*to_empty"):
    framework.numpy_array(torch.empty(2, 2, device="meta"), "state dict entry 'model.w'")
