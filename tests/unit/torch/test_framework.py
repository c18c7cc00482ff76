"""Tier 1: PyTorch's framework plug (``torch/framework.TorchFramework``, the core's
``NumpyArrays`` with tensors for leaves): ``ctl.checkpointer`` saves a tree of tensors whole
in Orbax's layout and restores it as tensors, against the in-process fake sidecars."""

import pytest
import torch

from sidecar._src.core import errors
from sidecar._src.torch.framework import TorchFramework
from tests.support import fake_sidecars
from tests.support.fake_sidecars import FakeSidecars

pytestmark = pytest.mark.unit


def test_tensors_are_saved_whole_and_restored_as_tensors_of_their_dtype():
  state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
           "b": torch.full((2,), 0.5, dtype=torch.bfloat16), "t": torch.arange(4)[::2]}
  with fake_sidecars.checkpointer(FakeSidecars(), framework=TorchFramework()) as ckpt:
    assert ckpt.save(1, state).durable.result(30) == 1
    out = ckpt.restore(1, {"w": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.bfloat16),
                           "t": torch.zeros(2, dtype=torch.int64)})
  assert all(isinstance(v, torch.Tensor) and torch.equal(v, state[k]) for k, v in out.items())
  assert out["b"].dtype == torch.bfloat16


def test_a_tensor_on_the_meta_device_is_refused_naming_its_leaf():
  with fake_sidecars.checkpointer(FakeSidecars(), framework=TorchFramework()) as ckpt, \
      pytest.raises(errors.InvalidArgumentError, match=r"leaf w is on the meta device"):
    ckpt.save(1, {"w": torch.empty(2, device="meta")})
