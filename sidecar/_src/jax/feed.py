"""``ctl.feed(sharding=...)``: the rows each device owns, and global ``jax.Array``s of them.

:func:`layout` reads a sharding of the batch dimension: which rows of every global
batch each host's devices own, so that host's sidecar produces exactly those; the
:class:`Layout` it returns assembles each leaf's per-host row blocks into one global
``jax.Array`` (each device's block straight from the arena: no copy on the CPU backend).
The feed itself (streams, state, stats) is the controller core's (``controller/feed.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from sidecar._src.controller.feed import BatchLayout, HostRows
from sidecar._src.core import errors
from sidecar._src.jax import transfer

# Batches a feed keeps ahead on accelerator devices (FeedOptions.device_prefetch=None).
# One waited-for put of a 4.8 MB batch takes ~4.5-4.9 ms on the lent TPU v5e, and the
# chip reaches its rate (~0.4-0.5 ms a batch) only with several puts in flight. No-op
# 4.8 MB batches, each used at once, one run there: 0 ahead 180/s, 4 895/s, 8 1,043/s,
# 16 1,000/s (made in the trainer's own thread instead, 4-16 ahead: 784-817/s).
DEVICE_PREFETCH = 8


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HostPlan(HostRows):
  """One host's rows (``feed.HostRows``: one process's part, where several share the host)
  and, for each of its row ranges, the devices that take those rows."""
  devices: tuple[tuple[jax.Device, ...], ...]


def plan(sharding: jax.sharding.Sharding, global_batch_size: int,
         device_hosts: Mapping[int, int], device_processes: Mapping[int, int] | None = None
         ) -> list[HostPlan]:
  """Splits the rows of a global batch among hosts by where ``sharding`` puts them.

  Where several processes share a host (``device_processes`` says whose each device is),
  each process's devices on it make a part of their own, which that process streams.
  """
  owners = device_processes or {}
  if not isinstance(sharding, jax.sharding.Sharding):
    raise errors.InvalidArgumentError(
        f"sharding must be a jax.sharding.Sharding, got {type(sharding).__name__}")
  if isinstance(sharding, jax.sharding.NamedSharding) and any(
      p is not None for p in tuple(sharding.spec)[1:]):
    raise errors.InvalidArgumentError(
        f"sharding {sharding.spec} splits a dimension after the batch; feeds split the leading "
        "(batch) dimension only: use PartitionSpec(axes) with one entry")
  local = set(jax.devices())
  missing: list[jax.Device] = [d for d in sharding.device_set if d not in local]
  if missing:
    raise errors.InvalidArgumentError(
        f"sharding uses devices {sorted(d.id for d in missing)} that this process does not "
        f"have (it has {sorted(d.id for d in local)})")
  try:
    index: Mapping[jax.Device, Any] = sharding.devices_indices_map((global_batch_size,))
  except Exception as e:
    n = _batch_shards(sharding)
    if n and global_batch_size % n:
      lower = global_batch_size // n * n
      raise errors.InvalidArgumentError(
          f"global_batch_size {global_batch_size} cannot be laid out by {sharding}: it splits "
          f"the batch into {n} shards; use a multiple of {n} "
          f"({f'{lower} or ' if lower else ''}{lower + n})") from None
    raise errors.InvalidArgumentError(
        f"global_batch_size {global_batch_size} cannot be laid out by {sharding}: {e}") from None
  by_host: dict[tuple[int, int], dict[tuple[int, int], list[jax.Device]]] = {}
  for device, (rows,) in index.items():
    start, stop, _ = rows.indices(global_batch_size)
    host = device_hosts.get(device.id)
    if host is None:
      raise errors.InvalidArgumentError(
          f"device {device.id} of the sharding belongs to no sidecar; the hosts declare "
          f"devices {sorted(device_hosts)} (sidecar serve --device-ids)")
    part = (host, owners.get(device.id, -1))
    by_host.setdefault(part, {}).setdefault((start, stop), []).append(device)
  plans = []
  for part in sorted(by_host):
    host = part[0]
    ranges = sorted(by_host[part])
    for (a, b), (c, d) in zip(ranges, ranges[1:]):
      if b > c:
        raise errors.InvalidArgumentError(
            f"devices of host {host} take overlapping rows [{a}, {b}) and [{c}, {d}); "
            "use a sharding that splits the batch evenly")
    plans.append(HostPlan(host, tuple(ranges), part[1],
                          devices=tuple(tuple(by_host[part][r]) for r in ranges)))
  return plans


def _batch_shards(sharding: jax.sharding.Sharding) -> int | None:
  """How many row blocks ``sharding`` cuts the batch into (None if it cannot say): a
  batch of one row per device is always laid out."""
  try:
    probe = sharding.devices_indices_map((len(sharding.device_set),))
    return len({rows.indices(len(sharding.device_set))[:2] for (rows,) in probe.values()})
  except Exception:
    return None


class Layout(BatchLayout):
  """A global batch laid out by ``sharding``: each leaf one global ``jax.Array``."""

  def __init__(self, sharding: jax.sharding.Sharding, global_batch_size: int,
               device_hosts: Mapping[int, int], device_processes: Mapping[int, int] | None = None):
    self.sharding = sharding
    self.global_batch_size = global_batch_size
    self.plans = plan(sharding, global_batch_size, device_hosts, device_processes)
    self.hosts: list[HostRows] = list(self.plans)
    self._devices = {(p.host_id, p.process): p.devices for p in self.plans}
    # On CPU devices a batch aliases its arena blocks (no transfer): nothing to overlap.
    if any(getattr(d, "platform", "cpu") != "cpu" for d in sharding.device_set):
      self.default_device_prefetch = DEVICE_PREFETCH

  def describe(self) -> Any:
    return [[d.id for d in ds] for p in self.plans for ds in p.devices]

  def release_dropped(self) -> None:
    transfer.release_dropped()  # ~0.1 us: JAX's queue of host arrays to let go of

  def assemble(self, blocks: Sequence[Sequence[Any]], hosts: Sequence[HostRows]) -> Any:
    arrays, devices = [], []
    for host, host_blocks in zip(hosts, blocks, strict=True):
      for range_devices, array in zip(self._devices[host.host_id, host.process], host_blocks,
                                      strict=True):
        for d in range_devices:
          arrays.append(array)
          devices.append(d)
    shape = (self.global_batch_size, *arrays[0].shape[1:])
    return transfer.global_array(shape, self.sharding, arrays, devices)
