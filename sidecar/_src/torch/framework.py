"""The PyTorch adapter of the controller core (``controller/framework.Framework``).

Each rank is one trainer process that owns one device; its global device id is its
rank, so the core's bookkeeping of which process drives which host (several ranks per
sidecar, each its own Worker session) works as for JAX. A stream's or a feed's arrays
become ``torch.Tensor``s over the arena (``tensors.from_array``: no copy; the tensor holds
its block), copied onto ``device`` when it is not the CPU. ``ctl.checkpointer`` saves a
tree of CPU tensors whole, by rank 0, in stock Orbax's layout; DCP's own layout is
``sidecar.torch.StorageWriter``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sidecar._src.arena.worker import TrainerProcess
from sidecar._src.ckptfmt.spec import KeyPath, LeafSpec
from sidecar._src.controller.framework import NumpyArrays, RestoreLeaf
from sidecar._src.controller.peers import Peers
from sidecar._src.core import dtypes as dtypes_lib, errors, trees
from sidecar._src.torch import distributed, tensors


def to_tensors(tree: Any, device: Any = None, *, non_blocking: bool = True) -> Any:
  """Every numpy leaf of ``tree`` as a tensor over its memory; on ``device`` if given
  and not the CPU (a copy, ``non_blocking`` from pinned memory)."""
  target = None if device is None else torch.device(device)

  def convert(leaf: Any) -> Any:
    if not isinstance(leaf, np.ndarray):
      return leaf
    t = tensors.from_array(leaf if leaf.ndim else leaf.reshape(()))
    if target is not None and target.type != "cpu":
      t = t.to(target, non_blocking=non_blocking)
    return t
  leaves, treedef = trees.flatten(tree)
  return trees.unflatten(treedef, [convert(leaf) for leaf in leaves])


def numpy_array(value: Any, where: str) -> np.ndarray:
  """A tensor (any device, any layout: copied to the CPU, contiguous) or array leaf as a
  host numpy array.

  Raises:
    InvalidArgumentError: a tensor on the meta device (it has no data); names ``where``.
  """
  if isinstance(value, torch.Tensor):
    t = value.detach()
    if t.device.type == "meta":
      raise errors.InvalidArgumentError(
          f"{where} is on the meta device: it has no data to save; materialise it first "
          "(module.to_empty(device=...) and its initialisation)")
    if t.device.type != "cpu" or not t.is_contiguous():
      t = t.to("cpu").contiguous()
    return tensors.as_array(t, where)
  return np.asarray(value)


class TorchFramework(NumpyArrays):
  """PyTorch: ``torch.Tensor``s, one device per rank, ``torch.distributed``. Its leaves
  are saved whole, as host arrays (the core's ``NumpyArrays`` with tensors for leaves)."""

  name = "torch"

  def peers(self) -> Peers:
    return distributed.peers()

  def process(self) -> TrainerProcess | None:
    r = distributed.ranks()
    return None if r.world_size == 1 else TrainerProcess(r.rank, (r.rank,))

  def local_device_ids(self) -> list[int]:
    return [distributed.ranks().rank]

  def to_device(self, tree: Any, device: Any) -> Any:
    return to_tensors(tree, device)

  def numpy_value(self, value: Any, where: str) -> np.ndarray:
    return numpy_array(value, where)

  def leaf_spec(self, path: KeyPath, value: Any, data: np.ndarray) -> LeafSpec:
    return LeafSpec.from_value(path, data)

  def target_leaf(self, want: Any, where: str) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(want, torch.Tensor):
      return (tuple(want.shape),
              dtypes_lib.dtype_of(tensors.dtype_name(want.dtype, where), where))
    return (tuple(np.shape(want)),
            dtypes_lib.dtype_of(np.asarray(want).dtype.name, where))

  def restored(self, leaf: RestoreLeaf, block: np.ndarray) -> Any:
    return tensors.from_array(block)
