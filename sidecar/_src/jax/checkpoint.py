"""JAX trees of a checkpoint: Orbax's names, leaf specs, the shards to save, restore targets.

Turns a pytree of ``jax.Array``s (numpy arrays, scalars) into the controller core's
neutral description (``controller/framework.SaveLeaf``: a leaf spec and this process's
replica-0 shards, each a ``framework.LocalShard``: its ``records.ShardRecord``, a host
buffer and its device) and a target of
``jax.ShapeDtypeStruct``s or arrays into the blocks a restore fills, then the filled
blocks back into global ``jax.Array``s. Leaves are named from ``core/trees``' key paths
(JAX's own walk) and shardings serialized as ``orbax.checkpoint`` does, byte for byte
(tests/unit/jax/test_checkpoint.py compares them with Orbax's).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sidecar._src.ckptfmt.records import ShardId, ShardRecord
from sidecar._src.ckptfmt.spec import KeyPath, LeafKind, LeafSpec, shard_index
from sidecar._src.controller.framework import (
  DeviceCopy,
  LocalShard,
  RestoreLeaf,
  RestoreTarget,
  SaveLeaf,
  check_tree,
  whole,
)
from sidecar._src.core import errors, trees
from sidecar._src.jax import transfer

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def serialized_sharding(sharding: jax.sharding.Sharding) -> str | None:
  """Orbax's serialized ``ShardingMetadata`` of ``sharding`` (what ``_sharding`` stores),
  as ``orbax.checkpoint``'s ``from_jax_sharding(s).to_serialized_string()`` makes it.

  Cached: every save describes every leaf, in the trainer's blocked time, and the string
  lists every device of the mesh (a leaf of a 4096-device mesh: ~7 ms); leaves share a
  few shardings.
  """
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh = sharding.mesh
    devices = mesh.devices.tolist() if isinstance(mesh.devices, np.ndarray) else mesh.devices
    data: dict[str, Any] = {
        "sharding_type": "NamedSharding",
        "shape": np.array(list(mesh.shape.values())).tolist(),
        "axis_names": list(mesh.axis_names),
        "axis_types": [str(a) for a in mesh.axis_types],
        "partition_spec": tuple(sharding.spec),
        "device_mesh": {"mesh": jax.tree.map(lambda d: {"id": d.id}, devices,
                                             is_leaf=lambda x: isinstance(x, jax.Device))},
    }
    return json.dumps(data)
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return json.dumps({"sharding_type": "SingleDeviceSharding",
                       "device_str": str(next(iter(sharding.device_set)))})
  log.warning("Sharding %s is not supported by Orbax's sharding metadata; it is not stored",
              type(sharding).__name__)
  return None


def leaf_spec(path: KeyPath, value: Any) -> LeafSpec:
  """Describes a ``jax.Array``, ``jax.ShapeDtypeStruct``, numpy array or scalar.

  Runs where the value lives (the worker); only the returned spec crosses to the sidecar.
  """
  if isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
    sharding = value.sharding
    return LeafSpec(
        key_path=tuple(path), shape=value.shape, dtype=value.dtype, kind=LeafKind.JAX_ARRAY,
        write_shape=sharding.shard_shape(value.shape) if sharding else None,
        sharding=serialized_sharding(sharding) if sharding else None)
  if isinstance(value, (np.ndarray, int, float, np.number)) and not isinstance(value, bool):
    return LeafSpec.from_value(path, value)
  raise errors.InvalidArgumentError(
      f"leaf {path!r}: cannot checkpoint a {type(value).__name__}; expected a"
      " jax.Array, jax.ShapeDtypeStruct, numpy array or int/float scalar")


# A shard's device-to-host copy goes in pieces of about this many bytes, split on the
# device by one jitted program: a single large transfer nearly stops a training loop that
# runs beside it, pieces cost it about a quarter as much (issue 44's probes on a TPU v5e,
# 1 GiB as 8 x 128 MiB: whole arrays 314 ms of steps lost, 64 / 16 / 4 MiB pieces 75-92 ms).
# 4 MiB: in saves on that chip (2026-12-05), 13-30 ms of steps lost a save against 3-65 ms
# for 16 MiB and 0.22-0.30 s for 64 MiB (docs/tpu.md).
PIECE_BYTES = 4 << 20
# Piece transfers in flight at once, in order, over all of a save's shards: the stager
# starts the next as it takes one.
PIECES_IN_FLIGHT = 4


class _Pieces:
  """A save's on-device pieces, in order, and how many of their transfers have started.

  The pieces stay on the device until :meth:`release` (the save is staged: its runner
  releases them), not only until each lands: till then an in-process rollback restores
  the step from them (:meth:`joined`) instead of waiting for the copy. That holds no
  more device memory than a save's start does (every piece is made at once), only
  longer: until the last piece landed and the sidecars answered.
  """

  __slots__ = ("arrays", "started", "_join", "_kept", "_lock")

  def __init__(self, arrays: list[jax.Array], join: Any = None):
    self.arrays: list[jax.Array | None] = list(arrays)
    self.started = 0
    # Makes each shard of the pieces again, in new buffers (None: none compiled, the
    # pieces then serve no rollback).
    self._join = join
    self._kept: list[jax.Array] | None = list(arrays)
    self._lock = threading.Lock()

  def release(self) -> None:
    """The save no longer needs its pieces for a rollback: each goes once it landed."""
    with self._lock:
      self._kept = None

  def joined(self) -> list[jax.Array] | None:
    """Each shard of these pieces made again on the device (device to device, not
    waited for), in new buffers of the caller's own: the save goes on reading its
    pieces, and a step that donates what is returned never touches them. None once
    released, or where no join compiled."""
    with self._lock:
      kept = self._kept
    if kept is None or self._join is None:
      return None
    return list(self._join(kept))

  def start_through(self, last: int) -> None:
    """Starts every transfer up to piece ``last`` (included) not started yet."""
    last = min(last, len(self.arrays) - 1)
    while self.started <= last:
      a = self.arrays[self.started]
      if a is not None:
        a.copy_to_host_async()
      self.started += 1

  def take(self, i: int) -> np.ndarray:
    """Piece ``i`` in host memory (waits for it); the device's piece goes (once
    released: :meth:`release`)."""
    self.start_through(i + PIECES_IN_FLIGHT - 1)
    a, self.arrays[i] = self.arrays[i], None
    if a is None:
      raise errors.ClosedError("this shard's host copy was already taken")
    return np.asarray(a)


class DeviceToHost(DeviceCopy):
  """A shard's device-to-host copy, started and not waited for, of on-device pieces that
  only the save holds: a step that donates the state reuses the state's memory, never
  the pieces', and the runtime orders the jitted split before that step. The pieces'
  transfers go in order, a few in flight (:data:`PIECES_IN_FLIGHT`), and each lands in
  its rows of the shard's arena block (:meth:`copy_into`): no whole host copy is made."""

  __slots__ = ("_pieces", "_first", "_rows", "_shard")

  def __init__(self, shape: tuple[int, ...], dtype: np.dtype, pieces: _Pieces, first: int,
               rows: tuple[tuple[int, int], ...], shard: int = 0):
    self.shape, self.dtype = tuple(shape), np.dtype(dtype)
    self._pieces, self._first, self._rows = pieces, first, rows
    self._shard = shard  # its place among the shards of ``pieces`` (``_Pieces.joined``)

  def release(self) -> None:
    self._pieces.release()

  def copy_into(self, out: np.ndarray) -> None:
    rows = out.reshape(1) if not self.shape else out  # a scalar: one row
    for k, (a, b) in enumerate(self._rows):
      np.copyto(rows[a:b], self._pieces.take(self._first + k).reshape(rows[a:b].shape))

  def result(self) -> np.ndarray:
    out = np.empty(self.shape, self.dtype)
    self.copy_into(out)
    return out


def _piece_rows(shape: tuple[int, ...], itemsize: int, piece_bytes: int
                ) -> tuple[tuple[int, int], ...]:
  """The leading-axis rows ``(start, stop)`` of each piece of a shard (one piece: a
  scalar, or rows larger than a piece); a multiple of 8 rows where pieces hold more (the
  tiles of a TPU's layout)."""
  if not shape or shape[0] <= 1:
    return ((0, shape[0] if shape else 1),)
  row = max(int(np.prod(shape[1:], dtype=np.int64)) * itemsize, 1)
  rows = max(piece_bytes // row, 1)
  if rows >= 8:
    rows -= rows % 8
  return tuple((a, min(a + rows, shape[0])) for a in range(0, shape[0], rows))


def _split_pieces(arrays, rows):
  """Each array's pieces (by ``rows``), new buffers of their own: a slice that is the
  whole array is copied, never forwarded (a donating step would reuse it)."""
  out = []
  for a, bounds in zip(arrays, rows):
    if len(bounds) == 1:
      out.append([jnp.copy(a)])
    else:
      out.append([jax.lax.slice_in_dim(a, s, e, axis=0) for s, e in bounds])
  return out


_split = jax.jit(_split_pieces, static_argnums=1)


def _join_pieces(pieces, counts):
  """Each shard of ``pieces`` (``counts[i]`` pieces for shard ``i``, in order) joined
  again, new buffers of its own (one piece is copied, never forwarded)."""
  out, first = [], 0
  for n in counts:
    mine = pieces[first:first + n]
    out.append(jnp.copy(mine[0]) if n == 1 else jnp.concatenate(mine, axis=0))
    first += n
  return out


_join = jax.jit(_join_pieces, static_argnums=1)


def _copies(pieces: list[jax.Array]) -> list[jax.Array]:
  """Each whole piece (a shard) copied on its device by the runtime: no program."""
  return [jax.device_put(p, p.sharding, may_alias=False) for p in pieces]


# The compiled splits and their joins (``_join``: the pieces made shards again, for a
# rollback), by what they split: (device, each shard's shape and dtype, its rows); None
# where the split's compilation failed (those shards go whole), a join None where its did.
_SPLITS: dict[tuple, Any] = {}
_COMPILING: set[tuple] = set()
_SPLITS_CHANGED = threading.Condition()
_MOST_SPLITS = 64  # states of that many layouts at once; beyond, the oldest are dropped


def _compiled_split(arrays: list[jax.Array], rows: tuple) -> Any:
  """The compiled split of ``arrays`` (one device's shards) by ``rows`` and its join, or
  None until a thread (started by the first call) has compiled them: a process's first
  save of a state does not wait for the compilation (0.33-0.40 s on a TPU v5e, longer
  than Orbax's whole first ``save()``); its shards go whole meanwhile."""
  key = (arrays[0].device, tuple((a.shape, a.dtype) for a in arrays), rows)
  with _SPLITS_CHANGED:
    if key in _SPLITS:
      return _SPLITS[key]
    if key in _COMPILING:
      return None
    _COMPILING.add(key)
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]
  # Not a daemon: the interpreter's exit waits for it (JAX's own exit handlers tear the
  # runtime down, and a compilation still running then aborts the process).
  threading.Thread(target=_compile_split, args=(key, avals, rows),
                   name="sidecar-split-compile").start()
  return None


def _compile_split(key: tuple, avals: list[jax.ShapeDtypeStruct], rows: tuple) -> None:
  compiled: tuple | None = None
  try:
    compiled = (_split.lower(avals, rows).compile(), None)
  except Exception:  # the shards of this layout go whole, as on a first save
    log.warning("save: the split of %d shards on %s into pieces did not compile; they go to "
                "the host whole", len(avals), key[0], exc_info=True)
  if compiled is not None:
    pieces = [jax.ShapeDtypeStruct(
        (e - s, *a.shape[1:]) if len(bounds) > 1 else a.shape, a.dtype, sharding=a.sharding)
        for a, bounds in zip(avals, rows) for s, e in bounds]
    try:
      compiled = (compiled[0], _join.lower(pieces, tuple(len(b) for b in rows)).compile())
    except Exception:  # saves go in pieces all the same; a rollback waits for the copy
      log.warning("save: the join of %d shards' pieces on %s did not compile; an in-process "
                  "rollback waits for a save's copy to land", len(avals), key[0],
                  exc_info=True)
  with _SPLITS_CHANGED:
    _COMPILING.discard(key)
    while len(_SPLITS) >= _MOST_SPLITS:
      del _SPLITS[next(iter(_SPLITS))]
    _SPLITS[key] = compiled
    _SPLITS_CHANGED.notify_all()


def wait_for_splits(timeout: float | None = None) -> bool:
  """Waits until no split is being compiled (a later save of the same state then goes in
  pieces); False if ``timeout`` passed first. For tests and benchmarks."""
  with _SPLITS_CHANGED:
    return _SPLITS_CHANGED.wait_for(lambda: not _COMPILING, timeout)


def save_leaves(tree: Any, *, device_copies: bool | None = None) -> list[SaveLeaf]:
  """The leaves of ``tree`` with this process's shards to save: of a ``jax.Array`` its
  addressable replica-0 shards; of a host value the whole of it (no device).

  A shard on a CPU device is a host array already (the arena copy made before ``save()``
  returns is the one copy); one on an accelerator is split on its device into pieces at
  once (one jitted program per device, not waited for) and comes as a
  :class:`DeviceToHost` of those pieces, so ``save()`` returns before the device-to-host
  transfers end. Until that program is compiled for the state's layout (on a thread
  that the first save starts), each shard is copied on its device whole instead, and
  goes to the host as one piece. Where a device lacks the memory for the copies, its
  shards' transfers are waited for instead.
  ``device_copies`` True or False takes one way for every device (None: by platform).
  """
  flat, _ = trees.flatten_with_path(tree)
  paths = [path for path, _ in flat]
  check_tree(paths, tree)
  out: list[tuple[LeafSpec, list]] = []
  on_device: list[tuple[list, int, jax.Array]] = []  # (the leaf's shards, slot, shard)
  for path, (_, value) in zip(paths, flat):
    spec = leaf_spec(path, value)
    shards: list = []
    if isinstance(value, jax.Array):
      for s in value.addressable_shards:
        if s.replica_id != 0:  # replicas: saved once
          continue
        shards.append([shard_index(s.index, value.shape), None, s.device.id])
        if not (s.device.platform != "cpu" if device_copies is None else device_copies):
          shards[-1][1] = np.asarray(s.data)
        else:
          on_device.append((shards, len(shards) - 1, s.data))
    else:
      data = np.asarray(value)
      shards.append([whole(data.shape), data, None])
    out.append((spec, shards))
  for shards, i, copy in _off_device(on_device):
    shards[i][1] = copy
  # The records last: an accelerator shard's data is known once _off_device chose its way.
  return [SaveLeaf(spec, tuple(
      LocalShard(ShardRecord.of(ShardId(spec.key_path, index), leaf, data), data, device)
      for index, data, device in shards)) for leaf, (spec, shards) in enumerate(out)]


# Device memory a save's on-device copies leave free at least (the next step's).
_COPY_HEADROOM = 0.05
_WHOLE = 1 << 62  # a piece size no shard reaches


def _off_device(on_device: list[tuple[list, int, jax.Array]], *,
                 piece_bytes: int | None = None
                 ) -> list[tuple[list, int, np.ndarray | DeviceCopy]]:
  """Each accelerator shard's way to host memory: a :class:`DeviceToHost` of on-device
  pieces (one jitted split per device, or whole copies while it compiles; the first
  transfers started), or, on a device without room for the copies, the host array
  itself (its transfers started together, then waited for)."""
  piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
  need: dict[jax.Device, int] = {}
  for _, _, data in on_device:
    need[data.device] = need.get(data.device, 0) + data.nbytes
  roomy = {d for d, n in need.items() if _fits(d, n)}
  out: list[tuple[list, int, np.ndarray | DeviceCopy]] = []
  for device in (d for d in need if d in roomy):
    mine = [x for x in on_device if x[2].device == device]
    arrays = [x[2] for x in mine]
    rows = tuple(_piece_rows(tuple(a.shape), a.dtype.itemsize, piece_bytes) for a in arrays)
    compiled = _compiled_split(arrays, rows)
    if compiled is not None:
      split, join = compiled
      pieces = _Pieces([p for per_shard in split(arrays) for p in per_shard], join)
    else:  # whole copies by the runtime, no program to compile: one piece each
      rows = tuple(_piece_rows(tuple(a.shape), a.dtype.itemsize, _WHOLE) for a in arrays)
      pieces = _Pieces(jax.device_put(arrays, [a.sharding for a in arrays], may_alias=False),
                       _copies)
    pieces.start_through(PIECES_IN_FLIGHT - 1)
    first = 0
    for shard, ((shards, i, data), bounds) in enumerate(zip(mine, rows)):
      out.append((shards, i, DeviceToHost(data.shape, data.dtype, pieces, first, bounds,
                                          shard)))
      first += len(bounds)
  waited = [x for x in on_device if x[2].device not in roomy]
  for _, _, data in waited:
    data.copy_to_host_async()
  if waited:
    log.info("save: devices %s lack the memory to copy the state there; their shards' "
             "transfers to the host are waited for", sorted(d.id for d in need if d not in roomy))
  out.extend((shards, i, np.asarray(data)) for shards, i, data in waited)
  return out


def _fits(device: jax.Device, nbytes: int) -> bool:
  """Whether ``device`` has ``nbytes`` free beside a headroom (True where it cannot say)."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # a backend without memory statistics
    return True
  limit = stats.get("bytes_limit")
  if not limit:
    return True
  return stats.get("bytes_in_use", 0) + nbytes <= limit * (1 - _COPY_HEADROOM)


def restore_target(target: Any) -> RestoreTarget:
  """The blocks of ``target`` (``jax.ShapeDtypeStruct``s with shardings, arrays) that this
  process fills: one per addressable device of a sharded leaf, else the whole leaf."""
  transfer.release_dropped()  # the blocks of trees restored before and dropped come back
  flat, treedef = trees.flatten_with_path(target)
  leaves, shardings = [], []
  for path, want in flat:
    sharding, shape = getattr(want, "sharding", None), tuple(np.shape(want))
    dtype = np.dtype(want.dtype if hasattr(want, "dtype") else np.asarray(want).dtype)
    if sharding is None:  # numpy or scalar leaf
      blocks: tuple = ((whole(shape), None),)
      devices: list = [None]
    else:
      by_device = sharding.addressable_devices_indices_map(shape)
      devices = list(by_device)
      blocks = tuple((shard_index(index, shape), d.id) for d, index in by_device.items())
    leaves.append(RestoreLeaf(path, shape, dtype, blocks))
    shardings.append((sharding, devices))

  started: dict[int, jax.Array] = {}  # id(leaf): its array, its transfers under way
  where = {id(leaf): i for i, leaf in enumerate(leaves)}

  def start(leaf: RestoreLeaf, blocks: list[np.ndarray]) -> None:
    sharding, devices = shardings[where[id(leaf)]]
    if sharding is not None:
      started[id(leaf)] = transfer.global_array(leaf.shape, sharding, blocks, devices)

  def build(filled: list[list[np.ndarray]]) -> Any:
    out: list[Any] = []
    for leaf, (sharding, devices), blocks in zip(leaves, shardings, filled, strict=True):
      if sharding is None:
        out.append(blocks[0] if leaf.shape else blocks[0][()])
      elif id(leaf) in started:
        out.append(started.pop(id(leaf)))
      else:
        out.append(transfer.global_array(leaf.shape, sharding, blocks, devices))
    return trees.unflatten(treedef, out)

  return RestoreTarget(tuple(leaves), build, start)


def restore_on_device(target: Any,
                      copies: Sequence[tuple[ShardRecord, DeviceCopy | np.ndarray]]
                      ) -> Any | None:
  """``target`` restored from a save's shards still on the devices (``copies``: this
  process's, as ``save_leaves`` made them, and a host array of each host value's, as
  saved), or None where they do not make the whole of it: a block no copy holds (another
  process saved it, or another sharding wants it), a host leaf none holds or of another
  shape or dtype, pieces released (the save was staged) or never joinable.

  Each device's pieces are joined into its shards once, device to device, in new buffers
  (``_Pieces.joined``: the save goes on reading its own, and a step that donates the
  restored state never touches them); a block on another device than its shard's (a
  replica) is copied there. A host leaf comes back as a new host array (a numpy scalar
  where it has no shape, as ``restore_target`` makes it): the trainer may change it in
  place, the save's own stays as saved. Nothing is waited for: the transfers run on the
  devices.
  """
  held: dict[tuple[KeyPath, tuple], DeviceToHost] = {}
  host: dict[KeyPath, np.ndarray] = {}
  for record, data in copies:
    if isinstance(data, np.ndarray):
      host[tuple(record.key_path)] = data
    elif isinstance(data, DeviceToHost):
      held[(tuple(record.key_path), record.index)] = data
    else:
      return None
  flat, treedef = trees.flatten_with_path(target)
  plan: list[tuple[tuple[int, ...], Any, list[tuple[jax.Device, DeviceToHost]]]
             | np.ndarray] = []
  for path, want in flat:
    sharding, shape = getattr(want, "sharding", None), tuple(np.shape(want))
    dtype = np.dtype(want.dtype if hasattr(want, "dtype") else np.asarray(want).dtype)
    if sharding is None:  # a host leaf: its value as saved, copied at save()
      value = host.get(tuple(path))
      if value is None or value.shape != shape or value.dtype != dtype:
        return None
      plan.append(value)
      continue
    blocks = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
      copy = held.get((tuple(path), shard_index(index, shape)))
      if copy is None or copy.dtype != dtype:
        return None
      blocks.append((device, copy))
    plan.append((shape, sharding, blocks))
  joined: dict[int, list[jax.Array]] = {}
  for _, _, blocks in (p for p in plan if not isinstance(p, np.ndarray)):
    for _, copy in blocks:
      if id(copy._pieces) not in joined:
        shards = copy._pieces.joined()
        if shards is None:
          return None
        joined[id(copy._pieces)] = shards
  out: list[Any] = []
  for leaf in plan:
    if isinstance(leaf, np.ndarray):
      out.append(leaf.copy() if leaf.shape else leaf[()])
      continue
    shape, sharding, blocks = leaf
    arrays = []
    for device, copy in blocks:
      a = joined[id(copy._pieces)][copy._shard]
      arrays.append(a if a.device == device else jax.device_put(a, device))
    out.append(jax.make_array_from_single_device_arrays(shape, sharding, arrays))
  return trees.unflatten(treedef, out)
