"""JAX trees of a checkpoint: Orbax's names, leaf specs, the shards to save, restore targets.

Turns a pytree of ``jax.Array``s (numpy arrays, scalars) into the controller core's
neutral description (``controller/framework.SaveLeaf``: a leaf spec and this process's
replica-0 shards, each a host buffer with its device) and a target of
``jax.ShapeDtypeStruct``s or arrays into the blocks a restore fills, then the filled
blocks back into global ``jax.Array``s. Leaves are named from ``core/trees``' key paths
(JAX's own walk) and shardings serialized as ``orbax.checkpoint`` does, byte for byte
(tests/unit/jax/test_checkpoint.py compares them with Orbax's).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import jax
import numpy as np

from sidecar._src.ckptfmt.spec import KeyPath, LeafKind, LeafSpec, shard_index
from sidecar._src.controller.framework import (
  HostCopy,
  RestoreLeaf,
  RestoreTarget,
  SaveLeaf,
  SaveShard,
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


class DeviceToHost(HostCopy):
  """A shard's device-to-host copy, started and not waited for, of an on-device copy
  that only the save holds: a step that donates the state reuses the state's memory,
  never this copy's, and the runtime orders the copy before that step."""

  __slots__ = ("_array",)

  def __init__(self, array: jax.Array):
    self._array: jax.Array | None = array
    self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
    array.copy_to_host_async()

  def result(self) -> np.ndarray:
    if self._array is None:
      raise errors.ClosedError("this shard's host copy was already taken")
    out, self._array = np.asarray(self._array), None  # the device's copy goes now
    return out


def save_leaves(tree: Any, *, device_copies: bool | None = None) -> list[SaveLeaf]:
  """The leaves of ``tree`` with this process's shards to save: of a ``jax.Array`` its
  addressable replica-0 shards; of a host value the whole of it (no device).

  A shard on a CPU device is a host array already (the arena copy made before ``save()``
  returns is the one copy); one on an accelerator is copied on its device at once (the
  copies dispatched together, not waited for) and comes as a :class:`DeviceToHost` of
  that copy, so ``save()`` returns before the device-to-host transfer ends. Where a
  device lacks the memory for the copy, its shards' transfers are waited for instead.
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
  for shards, i, host in _host_copies(on_device):
    shards[i][1] = host
  return [SaveLeaf(spec, tuple(SaveShard(*s) for s in shards)) for spec, shards in out]


# Device memory a save's on-device copies leave free at least (the next step's).
_COPY_HEADROOM = 0.05


def _host_copies(on_device: list[tuple[list, int, jax.Array]]
                 ) -> list[tuple[list, int, np.ndarray | HostCopy]]:
  """Each accelerator shard's way to host memory: a :class:`DeviceToHost` of an
  on-device copy, or, on a device without room for the copies, the host array itself
  (its transfers started together, then waited for)."""
  need: dict[jax.Device, int] = {}
  for _, _, data in on_device:
    need[data.device] = need.get(data.device, 0) + data.nbytes
  roomy = {d for d, n in need.items() if _fits(d, n)}
  copy = [x for x in on_device if x[2].device in roomy]
  copies = jax.device_put([x[2] for x in copy], [x[2].sharding for x in copy],
                          may_alias=False) if copy else []
  out: list[tuple[list, int, np.ndarray | HostCopy]] = [
      (shards, i, DeviceToHost(c)) for (shards, i, _), c in zip(copy, copies)]
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

  def build(filled: list[list[np.ndarray]]) -> Any:
    out: list[Any] = []
    for leaf, (sharding, devices), blocks in zip(leaves, shardings, filled, strict=True):
      if sharding is None:
        out.append(blocks[0] if leaf.shape else blocks[0][()])
      else:
        out.append(transfer.global_array(leaf.shape, sharding, blocks, devices))
    return trees.unflatten(treedef, out)

  return RestoreTarget(tuple(leaves), build)
