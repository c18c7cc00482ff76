"""Host arrays into ``jax.Array``s on devices, at the lowest per-call cost JAX has.

On the CPU backend a ``jax.Array`` made from a page-aligned numpy array aliases
its memory: the arena view becomes the array with no copy. ``jax.device_put``
gets there through 70-100 us of Python dispatch per call, which for a 4.8 MB
batch costs as much as copying it. Underneath, it ends in
``pxla.batched_device_put(aval, sharding, [x], [device])``; calling that
directly takes about 10 us. It is internal to JAX, so it is used only where
``device_put`` would make exactly that call (a numpy array, any dtype but
float0), and only if this JAX has it; everything else goes through
``jax.device_put``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from sidecar._src.core import trees

try:
  from jax._src.core import shaped_abstractify as _abstractify
  from jax._src.interpreters.pxla import batched_device_put as _batched_device_put
except ImportError:  # pragma: no cover - a JAX without them takes the public path
  _abstractify = _batched_device_put = None  # type: ignore[assignment]
try:
  from jax._src.lib import _jax as _xla_client
except ImportError:  # pragma: no cover
  _xla_client = None


@functools.cache
def _single(device: jax.Device) -> jax.sharding.SingleDeviceSharding:
  return jax.sharding.SingleDeviceSharding(device)


def _direct(x: Any) -> bool:
  return (_batched_device_put is not None and type(x) is np.ndarray
          and x.dtype != jax.dtypes.float0)


def put(x: Any, device: jax.Device) -> jax.Array:
  """``jax.device_put(x, device)`` for one array: the same array, with less overhead."""
  if _direct(x):
    return _batched_device_put(_abstractify(x), _single(device), [x], [device])
  return jax.device_put(x, device)


def put_many(xs: Sequence[Any], devices: Sequence[jax.Device]) -> list[jax.Array]:
  """``jax.device_put(xs, devices)``: each array onto its device."""
  return [put(x, d) for x, d in zip(xs, devices, strict=True)]


def to_devices(tree: Any, device: jax.Device) -> Any:
  """Every array leaf of ``tree`` onto ``device``; other leaves stay as they are."""
  return trees.map_leaves(
      lambda x: put(x, device) if isinstance(x, (np.ndarray, np.generic)) else x, tree)


def release_dropped() -> None:
  """Lets go now of the host arrays that dropped ``jax.Array``s aliased.

  An array made of a page-aligned numpy view (an arena block) holds the view until it
  dies; JAX then queues the release and carries it out at its next call into XLA or the
  next garbage collection (jax-ml/jax#14882), so the block would stay taken meanwhile.
  Called before work that allocates blocks (a restore's reads): trees the user
  dropped give theirs back first.
  """
  if _xla_client is not None and hasattr(_xla_client, "collect_garbage"):
    _xla_client.collect_garbage()


@functools.lru_cache(maxsize=256)
def _order(sharding: jax.sharding.Sharding, shape: tuple[int, ...]
           ) -> tuple[dict[jax.Device, int], tuple[int, ...]] | None:
  """The position of each addressable device in ``sharding``'s own order, and its shard
  shape for a global ``shape``; None where the sharding cannot say (the public path)."""
  try:
    assignment = sharding._addressable_device_assignment
    return {d: i for i, d in enumerate(assignment)}, tuple(sharding.shard_shape(shape))
  except Exception:
    return None


def global_array(shape: tuple[int, ...], sharding: jax.sharding.Sharding,
                 xs: Sequence[Any], devices: Sequence[jax.Device]) -> jax.Array:
  """One global ``jax.Array`` of ``shape`` from each device's block ``xs[i]``.

  One call into JAX's runtime for all the blocks where they are numpy arrays of the
  sharding's shard shape, one for each of its addressable devices (a feed's batch leaf
  costs one Python call, not a put per device and an assembly): what
  ``jax.device_put(x, sharding)`` ends in. Else each block is put, then assembled.
  """
  order = _order(sharding, tuple(shape)) if _batched_device_put is not None else None
  if (order is not None and len(devices) == len(order[0])
      and all(_direct(x) and x.shape == order[1] for x in xs)):
    where, _ = order
    try:
      ranked = sorted(range(len(devices)), key=lambda i: where[devices[i]])
    except KeyError:  # a device the sharding does not hold: the public path says so
      ranked = None
    if ranked is not None and len({xs[i].dtype for i in ranked}) == 1:
      aval = _abstractify(xs[0]).update(shape=tuple(shape))
      return _batched_device_put(aval, sharding, [xs[i] for i in ranked],
                                 [devices[i] for i in ranked])
  return jax.make_array_from_single_device_arrays(shape, sharding, put_many(xs, devices))
