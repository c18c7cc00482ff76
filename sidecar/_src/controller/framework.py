"""The framework adapter: what the controller core asks of JAX, of PyTorch, or of nothing.

The core (``sidecar/_src/controller/``) knows hosts, sessions and workers, calls,
streams, the rows of a global batch each host produces, and the checkpoint protocol
over shards described with no framework's types: a leaf's spec (key path, global shape,
dtype name) and each shard's ``records.ShardRecord`` (its key path, its index as
``((start, stop), ...)`` per dimension, leaf number, dtype, shape, size), its elements a
host numpy buffer beside it. It walks trees with ``core/trees.py``, exchanges values between
processes through ``controller/peers.Peers``, and imports no framework. Whatever needs
one lives in that framework's adapter package, behind the interfaces below::

  sidecar.jax.Controller (jax/controller.py)        sidecar.torch (torch/)
    .feed(sharding=...) -> jax/feed.Layout        DataLoader -> a BatchLayout of ranks
    framework=JaxFramework (jax/framework.py)     framework=a torch Framework
                    \\                               /
                     controller.Controller (the core): hosts, calls, streams,
                     open_feed(layout=...) -> Feed, checkpointer() -> Checkpointer
                                      |
                     Framework: devices, arrays, shards (this module)
                     BatchLayout: rows of a global batch -> arrays (controller/feed.py)
                     Peers: exchanges between processes (controller/peers.py)

What an adapter implements:

- :class:`Framework` (this module), an ABC: ``to_device`` (``ctl.stream(device=)``),
  ``save_leaves`` (a state tree's shards that this process saves: replica 0 only, each
  a :class:`LocalShard`: its record, no host chosen yet, with its device and a host
  buffer, or a :class:`DeviceCopy` on its way to one),
  ``restore_target`` (the blocks a restore fills and how to make the framework's arrays of
  them); and where the one-process, no-device
  defaults do not fit: ``peers`` (the job's processes), ``process`` and
  ``local_device_ids`` (this process's identity), ``worker`` (a Worker of its own class).
- ``controller/feed.BatchLayout``: which rows of each global batch each host produces,
  and how one leaf's per-host row blocks become the framework's batch array.
- ``controller/peers.Peers``: ``publish`` and ``read`` over the framework's key-value
  store (``jax.distributed``'s, ``torch.distributed``'s).

A key path must be what stock Orbax names the leaf: ``core/trees.py`` makes them, from
``jax.tree_util``'s paths where JAX is loaded, so registered pytrees keep their names.
:class:`NumpyArrays` is the adapter of no framework: numpy arrays and scalars, one
process, no devices; with it a core Controller calls, streams and checkpoints host
arrays without importing any framework.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.arena.worker import TrainerProcess, Worker
from sidecar._src.ckptfmt.records import ShardId, ShardRecord
from sidecar._src.ckptfmt.spec import Index, KeyPath, LeafSpec
from sidecar._src.controller.peers import LocalPeers, Peers
from sidecar._src.core import errors, trees


class DeviceCopy(abc.ABC):
  """A shard's copy into host memory, started and not waited for: an accelerator's
  device-to-host transfer, of a copy the trainer's next steps cannot touch.

  A save returns once every shard is a host array or a ``DeviceCopy``; a thread of the
  save then has each written into its arena block (:meth:`copy_into`). An adapter
  returns one only where its own copy keeps the shard safe from what the trainer does
  next (a jitted step that donates the state, say).
  """

  shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

  @abc.abstractmethod
  def result(self) -> np.ndarray:
    """The shard's elements in host memory, once the copy has landed (waits for it)."""

  def copy_into(self, out: np.ndarray) -> None:
    """Writes the shard's elements into ``out`` (an arena block of its shape and dtype)
    as they land (waits for them). An adapter whose copy comes in pieces writes each
    as it lands, making no whole host copy; by default, :meth:`result` copied once."""
    shm.copy(out, self.result())

  def release(self) -> None:  # noqa: B027 (a hook)
    """The save is staged: an adapter that keeps its copy on the device for an
    in-process rollback (:meth:`Framework.restore_on_device`) lets it go."""


@dataclasses.dataclass(frozen=True, slots=True)
class LocalShard:
  """One shard of a leaf that this process saves: its record, and beside it its elements
  and the device they lie on; no description of its own (what the shard is, is
  ``record``'s). The core only chooses the host that stages it (``record.on(host)``).

  Attributes:
    record: the shard's ``records.ShardRecord``, its host None (not chosen yet):
      ``ShardRecord.of(ShardId(key_path, index), leaf, data)``, ``leaf`` the leaf's number
      in :meth:`Framework.save_leaves`' list.
    data: its elements: a host array of the shard's shape (copied once into the arena
      before ``save()`` returns), or a :class:`DeviceCopy` on its way there (copied once
      it has landed, after ``save()`` returned).
    device_id: the global id of the device it lies on (the sidecar of that device's
      host stages it); None: a host value, which process 0 alone saves, through its
      first host.
  """
  record: ShardRecord
  data: np.ndarray | DeviceCopy
  device_id: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class SaveLeaf:
  """One leaf of a state tree to save: its spec (the same in every process) and the
  shards this process saves (of replicated shards only replica 0, by whoever holds it)."""
  spec: LeafSpec
  shards: tuple[LocalShard, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreLeaf:
  """One leaf of a restore target: what it must be, and the blocks this process fills.

  Attributes:
    key_path: the leaf's name in the checkpoint (as stock Orbax names it).
    shape: its global shape; ``dtype``: its dtype.
    blocks: ``(index, device id or None)`` of each block to fill: one per addressable
      device, or the whole leaf on the host (None).
  """
  key_path: KeyPath
  shape: tuple[int, ...]
  dtype: np.dtype
  blocks: tuple[tuple[Index, int | None], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreTarget:
  """What a restore fills: ``leaves`` in order, and ``build``, which makes the restored
  tree of ``blocks[i][j]`` (leaf ``i``'s ``j``-th block, a host array) in that order;
  ``start``, where given, is called with each leaf and its blocks as soon as they are
  read (its transfers to the devices then overlap the other reads)."""
  leaves: tuple[RestoreLeaf, ...]
  build: Callable[[list[list[np.ndarray]]], Any]
  start: Callable[[RestoreLeaf, list[np.ndarray]], None] | None = None


def check_tree(paths: Sequence[KeyPath], tree: Any) -> None:
  """Raises unless ``tree``'s leaves (at ``paths``) can be saved under Orbax's names."""
  if not paths:
    raise errors.InvalidArgumentError("tree has no leaves to save")
  if len(paths) == 1 and not paths[0]:
    raise errors.InvalidArgumentError(
        f"save a tree of arrays such as {{'w': w}}, not a bare {type(tree).__name__}: "
        "stock Orbax names each leaf by its path in the tree")


def whole(shape: Sequence[int]) -> Index:
  """The index of a whole array of ``shape``."""
  return tuple((0, int(n)) for n in shape)


class Framework(abc.ABC):
  """What the controller core needs of the trainer's framework; one per Controller.

  Subclasses implement the three abstract methods; the others have the answers of one
  process that owns no device.
  """

  name: str = "none"

  def peers(self) -> Peers:
    """This job's trainer processes (a Controller's default ``peers``)."""
    return LocalPeers()

  def process(self) -> TrainerProcess | None:
    """Under several trainer processes, this one's index and devices (told to its
    sidecar at attach); else None. Must not start a framework that is not running."""
    return None

  def local_device_ids(self) -> list[int]:
    """The global ids of this process's devices (a job of several processes learns
    which host owns which device from them)."""
    return []

  def worker(self, address: str | None, *, timeout: float, token: str | None = None) -> Worker:
    """A Worker attached to the sidecar at ``address`` (None: ``$SIDECAR_ADDRESS``),
    presenting ``token`` at attach (None: ``$SIDECAR_TOKEN``)."""
    return Worker(address, timeout=timeout, process=self.process(), token=token)

  @abc.abstractmethod
  def to_device(self, tree: Any, device: Any) -> Any:
    """Every array leaf of ``tree`` (host arrays, maybe arena views) onto ``device``;
    what is made of a view must keep it alive (it holds the view's block)."""

  @abc.abstractmethod
  def save_leaves(self, tree: Any) -> list[SaveLeaf]:
    """The leaves of state ``tree``, in order, with the shards this process saves: each
    a :class:`LocalShard` whose record numbers its leaf by its place in this list and
    leaves the host to the core (None).

    Raises:
      InvalidArgumentError: a leaf that cannot be saved (naming it), or no leaves
        (:func:`check_tree`).
    """

  @abc.abstractmethod
  def restore_target(self, target: Any) -> RestoreTarget:
    """The leaves of restore ``target`` (the framework's abstract or concrete arrays),
    the blocks this process fills, and how they become the restored tree."""

  def restore_on_device(self, target: Any,
                        copies: Sequence[tuple[ShardRecord, DeviceCopy | np.ndarray]]
                        ) -> Any | None:
    """``target`` restored from the copies a save not staged yet still holds on the
    devices (``copies``: this process's shards of it, as :meth:`save_leaves` made them,
    and a host array of its own of each host value's, as saved: hand back a copy),
    in arrays of the trainer's own (never the buffers the save goes on reading); None
    where they do not make the whole of it. An in-process rollback's way not to wait for
    the save's copy (``controller/checkpoint/rollback.py``). By default None: an
    adapter without device copies keeps none."""
    del target, copies
    return None


class NumpyArrays(Framework):
  """No framework: numpy arrays and int/float scalars, one process, no devices.

  Saves each leaf whole (by process 0); restores onto a tree of numpy arrays (or of
  anything with ``shape`` and ``dtype``) as numpy arrays (scalars as numpy scalars).
  A framework whose leaves are host values saved whole (PyTorch's tensors in Orbax's
  layout, ``torch/framework.py``) overrides only the four leaf hooks below.
  """

  name = "numpy"

  def to_device(self, tree: Any, device: Any) -> Any:
    raise errors.InvalidArgumentError(
        f"device={device!r}: this controller has no framework to put arrays on a device; "
        "use sidecar.jax.Controller (JAX) or leave device=None for numpy arrays")

  def numpy_value(self, value: Any, where: str) -> np.ndarray:
    """A leaf's elements as a numpy array (``where`` names it in errors)."""
    del where
    return np.asarray(value)

  def leaf_spec(self, path: KeyPath, value: Any, data: np.ndarray) -> LeafSpec:
    """The spec of leaf ``value`` at ``path`` (``data``: its host array)."""
    del data
    return LeafSpec.from_value(path, value)

  def target_leaf(self, want: Any, where: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a restore target's leaf asks for."""
    del where
    return (tuple(np.shape(want)),
            np.dtype(want.dtype if hasattr(want, "dtype") else np.asarray(want).dtype))

  def restored(self, leaf: RestoreLeaf, block: np.ndarray) -> Any:
    """The framework's value of a restored leaf over its host ``block`` (no copy)."""
    return block if leaf.shape else block[()]

  def save_leaves(self, tree: Any) -> list[SaveLeaf]:
    flat, _ = trees.flatten_with_path(tree)
    check_tree([path for path, _ in flat], tree)
    out = []
    for i, (path, value) in enumerate(flat):
      data = self.numpy_value(value, f"leaf {'.'.join(map(str, path))}")
      spec = self.leaf_spec(path, value, data)
      record = ShardRecord.of(ShardId(spec.key_path, whole(data.shape)), i, data)
      out.append(SaveLeaf(spec, (LocalShard(record, data, None),)))
    return out

  def restore_target(self, target: Any) -> RestoreTarget:
    flat, treedef = trees.flatten_with_path(target)
    leaves = []
    for path, want in flat:
      shape, dtype = self.target_leaf(want, str(path))
      leaves.append(RestoreLeaf(path, shape, dtype, ((whole(shape), None),)))

    def build(blocks: list[list[np.ndarray]]) -> Any:
      out = [self.restored(leaf, b[0]) for leaf, b in zip(leaves, blocks)]
      return trees.unflatten(treedef, out)

    return RestoreTarget(tuple(leaves), build)
