"""Restores for :class:`~sidecar._src.controller.checkpoint.checkpointer.Checkpointer`: a step's
shards onto a target, resharded, and where they came from.

A restore takes each shard from wherever a live copy is: the arena of the host that
staged it, a replica on another sidecar, storage last (the sources it asks for, in order:
each shard's read and fallback are ``shard_reads.ShardReads``'); it assembles the blocks of
the target's shardings (resharding where they differ from the saved ones) and says where
the shards came from (:class:`RestoreStats`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import records
from sidecar._src.ckptfmt.records import SavedLeaf, ShardId, ShardRecord
from sidecar._src.ckptfmt.spec import KeyPath
from sidecar._src.ckptfmt.tiers import Tier
from sidecar._src.controller.checkpoint.client import CheckpointTransport
from sidecar._src.controller.checkpoint.shard_reads import (
  ShardRead,
  ShardReads,
  Source,
  tier_of,
  warn_unchecked,
)
from sidecar._src.controller.framework import Framework, RestoreLeaf, RestoreTarget
from sidecar._src.core import errors, interrupts

log = logging.getLogger(__name__)
# Threads a restore checks the crc32c of mapped RAM copies on (the check lets go of the GIL).
_CHECK_THREADS = min(8, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreStats:
  """Where the shards of a restore came from, by source: ``"ram:host0"`` (the arena of
  the host that staged it), ``"replica:host1"`` (the replica host 1 keeps), ``"storage"``,
  ``"device"`` (a save not staged yet, from its copies on the devices: an in-process
  rollback's, ``Driver.restore_on_device``).

  ``shards[source]`` and ``bytes[source]`` count each stored shard once, however many
  target blocks it fills. ``tier`` names the tier the restore read, for a progress line:
  ``"ram"``, ``"replica"`` or ``"storage"``, ``"mixed"`` where shards came from several
  (``tiers`` then says how many bytes from each).
  """
  step: int
  seconds: float
  shards: dict[str, int]
  bytes: dict[str, int]
  data_state: Any = None  # the data position saved with the step, where the restore read it

  @property
  def tiers(self) -> dict[str, int]:
    """Bytes read from each tier (``"ram"``, ``"replica"``, ``"storage"``), whatever host."""
    out: dict[str, int] = {}
    for source, n in self.bytes.items():
      tier = tier_of(source)
      out[tier] = out.get(tier, 0) + n
    return out

  @property
  def tier(self) -> str:
    """``"ram"``, ``"replica"`` or ``"storage"``: where every shard came from; ``"mixed"``
    where they came from several tiers; ``"none"`` where the step had no shard."""
    tiers = {tier_of(source) for source in self.shards}
    if not tiers:
      return "none"
    return tiers.pop() if len(tiers) == 1 else "mixed"

  def summary(self) -> str:
    parts = [f"{n} shards ({shm.format_size(self.bytes[s])}) from {s}"
             for s, n in sorted(self.shards.items())]
    return f"restored step {self.step} in {self.seconds:.2f} s: " + (", ".join(parts) or "nothing")


class Restorer:
  """Reads committed items onto target shardings, through ``client``.

  Args:
    client: the sidecars.
    directory: the checkpoint directory (absolute), for messages.
    hosts: every sidecar host; ``local``: those this process stages into and reads through.
    device_hosts: the host of each device id.
    mapped: the hosts whose arenas this process maps.
    ask_all: ask every host for its RAM copies (else only the local ones).
    framework: the blocks of a target to fill, and the arrays made of them.
  """

  def __init__(self, *, client: CheckpointTransport, directory: str, hosts: Sequence[int],
               local: Sequence[int], device_hosts: dict[int, int], mapped: set[int],
               ask_all: bool, framework: Framework):
    self._framework = framework
    self._client, self.directory = client, directory
    self._hosts, self._local, self._device_hosts = hosts, local, device_hosts
    self._mapped, self._ask_all = mapped, ask_all
    self._reads = ShardReads(client, mapped)

  def restore(self, final_dir: str, step: int, target: Any, *,
              progress: Callable[[str], None] | None = None, taken_over: bool = False
              ) -> tuple[Any, RestoreStats]:
    """Restores the committed final_dir at ``final_dir`` onto ``target``'s shardings;
    returns the tree and where its shards came from.

    ``taken_over``: a step the sidecars took over, durable or not, from their RAM tiers
    only (:meth:`taken_over`: each host's part); its data position is then the
    returned stats' ``data_state``."""
    t0, done, last = time.perf_counter(), 0, [time.perf_counter()]
    if taken_over:
      manifest = self.taken_over(final_dir, step)
    else:
      manifest = interrupts.wait(self._client.info(self._local[0], final_dir))
    if manifest.stock:
      warn_unchecked(final_dir, "stock Orbax")
    saved = {leaf.key_path: leaf for leaf in manifest.leaves}
    stored: dict[KeyPath, list[ShardRecord]] = {}  # each leaf's shards, as the save wrote them
    for rec in manifest.shards:
      stored.setdefault(rec.key_path, []).append(rec)
    owners = {r.id: r.host for r in manifest.shards if r.host is not None}  # who staged it
    wanted = self._framework.restore_target(target)
    flat = wanted.leaves
    for want in flat:
      self._check_leaf(want, saved, step)
    # A step taken over is in the RAM tiers of the hosts that staged it, nowhere else yet.
    held, gone = (({c.id: [Source(c.host, Tier.RAM)] for c in manifest.shards
                    if c.host is not None}, [])
                  if taken_over else self._holdings(final_dir))
    # Copies this process maps are checked here, on threads this restore owns, while the
    # leaves read go on to their devices; a leaf whose copy fails its check is done again.
    with concurrent.futures.ThreadPoolExecutor(_CHECK_THREADS, "sidecar-restore-check") as checks:
      reads = self._read_all(final_dir, flat, stored, held, checks, storage=not taken_over)
      shards, lost, out = {}, [], []
      unread = collections.Counter(k.key_path for k in reads)  # a leaf's shards still to come
      try:
        for k, r in reads.items():
          try:
            shards[k] = interrupts.wait(r.ready)
            unread[k.key_path] -= 1
          except errors.SidecarError as e:
            lost.append((k, e.with_traceback(None)))  # no cycle through this frame
          # Each leaf whose shards are all read goes on to its devices while others are read.
          while not lost and len(out) < len(flat) and not unread[flat[len(out)].key_path]:
            out.append(self._blocks(final_dir, flat[len(out)], stored, shards, wanted))
          if progress is not None and time.perf_counter() - last[0] >= 1.0:
            last[0] = time.perf_counter()
            progress(f"restoring step {step}: {len(shards)} of {len(reads)} shards read")
        again = set()  # leaves with a shard whose first copy failed its check
        for k, r in reads.items():
          if k not in shards:
            continue
          try:
            checked = interrupts.wait(r.out)
          except errors.SidecarError as e:
            lost.append((k, e.with_traceback(None)))
            continue
          if checked[0] is not shards[k][0]:
            shards[k] = checked
            again.add(k.key_path)
      except KeyboardInterrupt:
        reads.clear()  # the traceback keeps this frame: let the blocks go
        shards.clear()
        out.clear()
        raise
    if lost:
      needed = sum(r.out.result()[0].nbytes for r in reads.values() if r.out.exception() is None)
      reads.clear()  # the error's traceback keeps this frame: let the blocks read go
      shards.clear()
      out.clear()
      raise self._failure(step, lost, owners,
                          {h: list(p) for h, p in manifest.replicas.items()}, gone, needed,
                          {w.key_path: w.dtype for w in flat})
    for i, want in enumerate(flat[:len(out)]):
      if want.key_path in again:
        out[i] = self._blocks(final_dir, want, stored, shards, wanted)
    for want in flat[len(out):]:
      out.append(self._blocks(final_dir, want, stored, shards, wanted))
    for blocks in out:
      done += sum(b.nbytes for b in blocks)
      now = time.perf_counter()
      if progress is not None and now - last[0] >= 1.0:
        last[0] = now
        progress(f"restoring step {step}: {shm.format_size(done)} "
                 f"({done / (now - t0) / 1e9:.2f} GB/s)")
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for data, source in shards.values():
      counts[source.label] = counts.get(source.label, 0) + 1
      sizes[source.label] = sizes.get(source.label, 0) + data.nbytes
    stats = RestoreStats(step, time.perf_counter() - t0, counts, sizes,
                         data_state=manifest.data_state)
    return wanted.build(out), stats

  def taken_over(self, final_dir: str, step: int) -> records.Manifest:
    """The manifest of a step the sidecars took over, durable or not: every host's part
    (Info ``taken_over``) put together, the data position the committer's holds.
    ShardsLostError where the parts do not cover every leaf (a host's write failed and
    it let its part go, a host is gone): it cannot be restored whole."""
    futures = {}
    for h in self._hosts:
      try:
        futures[h] = self._client.info(h, final_dir, taken_over=True)
      except errors.SidecarError:  # a host known lost
        continue
    parts = []
    for f in futures.values():
      try:
        parts.append(interrupts.wait(f))
      except (errors.InvalidArgumentError, errors.HostLostError):
        continue  # no part there (a host the step is not on), or gone: coverage says
    leaves = next((p.leaves for p in parts if p.leaves), ())
    shards = {r.id: r for p in parts for r in p.shards}
    covered: dict[KeyPath, int] = {}
    for r in shards.values():
      covered[r.key_path] = covered.get(r.key_path, 0) + math.prod(b - a for a, b in r.index)
    short = [".".join(map(str, leaf.key_path)) for leaf in leaves
             if covered.get(leaf.key_path, 0) < math.prod(leaf.shape)]
    if not parts or short:
      raise errors.ShardsLostError(
          f"step {step} of {self.directory} (taken over by the sidecars, not durable yet) "
          "cannot be restored whole from their RAM tiers: "
          + (f"leaves {short} lack shards there" if parts else "no host holds it")
          + "; restore a committed step (latest_step())")
    data_state = next((p.data_state for p in parts if p.data_state is not None), None)
    return records.Manifest(parts[0].format, leaves, list(shards.values()), data_state,
                            step=step)

  @staticmethod
  def _check_leaf(want: RestoreLeaf, saved: dict[KeyPath, SavedLeaf], step: int) -> None:
    kp = want.key_path
    name = ".".join(map(str, kp))
    if kp not in saved:
      raise errors.InvalidArgumentError(
          f"target leaf {name!r} is not in step {step}; it has "
          f"{sorted('.'.join(map(str, k)) for k in saved)}")
    leaf = saved[kp]
    shape, dtype = want.shape, want.dtype
    if shape != leaf.shape or dtype.name != leaf.dtype:
      raise errors.InvalidArgumentError(
          f"target leaf {name!r} is {dtype.name}{list(shape)} but step {step} saved "
          f"{leaf.dtype}{list(leaf.shape)}")

  def _holdings(self, final_dir: str) -> tuple[dict[ShardId, list[Source]], list[int]]:
    """Every live RAM copy of each shard, as a :class:`Source`, and the hosts that did
    not answer. Tier ``RAM``: the arena of the host that staged it; ``REPLICA``: one another
    sidecar sent."""
    where: dict[ShardId, list[Source]] = {}
    gone = []
    hosts = self._hosts if self._ask_all else self._local
    futures: dict[int, concurrent.futures.Future] = {}
    for h in hosts:
      try:
        futures[h] = self._client.held(h, self.directory, timeout=5)
      except errors.SidecarError:  # a host known lost
        gone.append(h)
    for h, f in futures.items():
      try:
        held = f.result()
      except errors.SidecarError:
        gone.append(h)
        continue
      copies = [(shard, Tier.RAM) for shard in held.own.get(final_dir, [])]
      copies += [(shard, Tier.REPLICA) for shards in held.replicas.get(final_dir, {}).values()
                 for shard in shards]
      for shard, tier in copies:
        where.setdefault(shard, []).append(Source(h, tier))
    return where, gone

  def _sources(self, key: ShardId, held: dict[ShardId, list[Source]], host: int,
               storage: bool = True) -> list[Source]:
    """Where to read a shard, in order: RAM copies (the target block's host, then the
    hosts whose arenas this process maps, then the rest; own copies before replicas),
    then (``storage``) storage through the block's host or this process's."""
    def rank(copy: Source) -> tuple:
      return (copy.host != host, copy.host not in self._mapped, copy.tier is not Tier.RAM,
              copy.host)
    tries = sorted(held.get(key, []), key=rank)
    return tries + ([Source(h, Tier.STORAGE) for h in dict.fromkeys([host, *self._local])]
                    if storage else [])

  def _read_all(self, final_dir: str, flat, stored, held,
                checks: concurrent.futures.Executor, *, storage: bool = True
                ) -> dict[ShardId, ShardRead]:
    """Starts every stored-shard read a restore needs, all at once: they overlap."""
    reads = {}
    for want in flat:
      kp = want.key_path
      for region, device_id in want.blocks:
        host = self._local[0] if device_id is None else self._device_hosts.get(
            device_id, self._local[0])
        for record in stored[kp]:
          if record.id in reads or not _overlaps(record.index, region):
            continue
          # A block for no device is the restored value itself (a numpy array, a torch
          # tensor), which training may write in place: it comes copy-on-write, so the
          # RAM-tier copy it maps stays as saved. A device's block is put there (copied, or
          # on a CPU device an immutable jax.Array over it).
          reads[record.id] = self._reads.start(
              final_dir, record, self._sources(record.id, held, host, storage), want.dtype,
              checks,
              private=device_id is None and record.index == region)
    return reads

  def _failure(self, step: int, lost, owners: dict, placed: dict[int, list[int]],
               gone: list[int], read: int, dtypes: dict[KeyPath, np.dtype]
               ) -> errors.SidecarError:
    """The error of a restore with shards that no source gave: ResourceExhaustedError
    where an arena had no room for one (the data is intact), another failure's own kind
    (a deadline), ShardsLostError only where no copy was there or valid."""
    full = [(k, e) for k, e in lost if isinstance(e, errors.ResourceExhaustedError)]
    if full:
      nbytes = sum(math.prod(b - a for a, b in index) * dtypes[kp].itemsize
                   for (kp, index), _ in full)
      return errors.ResourceExhaustedError(
          f"step {step} of {self.directory} cannot be restored now: no arena had room for "
          f"{len(full)} of its shards ({shm.format_size(nbytes)}; "
          f"{shm.format_size(read)} of the others were read). The data is intact: {full[0][1]}. "
          "Drop the trees restored earlier that you no longer need (del; gc.collect() if "
          "your code keeps them in a reference cycle), restore fewer at once, or start the "
          "sidecars with a larger --shm-size")
    other = next((e for _, e in lost if not isinstance(e, errors.ShardsLostError)), None)
    if other is not None:
      return other
    return self._lost(step, lost, owners, placed, gone)

  def _lost(self, step: int, lost, owners: dict, placed: dict[int, list[int]],
            gone: list[int]) -> errors.SidecarError:
    """The error of a restore with shards that no copy could give."""
    by_array: dict[KeyPath, list] = {}
    for (kp, index), _ in lost:
      by_array.setdefault(kp, []).append(index)
    owners_lost = sorted({owners[k] for k, _ in lost if k in owners})
    holders = {p for h in owners_lost for p in placed.get(h, [])}
    gone_hosts = sorted(set(gone) | {h for h in {*owners_lost, *holders}
                                     if h not in self._hosts})
    arrays = "; ".join(
        f"array {'.'.join(map(str, kp))!r} shards {[[list(i) for i in x] for x in idx]}"
        for kp, idx in by_array.items())
    first = str(lost[0][1])
    return errors.ShardsLostError(
        f"step {step} of {self.directory} cannot be restored: {len(lost)} shards have no live "
        f"copy and no valid stored copy: {arrays}"
        + (f" (staged by hosts {owners_lost}" + (f", replicated on hosts {sorted(holders)}"
                                                  if holders else "") + ")"
           if owners_lost else "")
        + f"; hosts gone: {gone_hosts or 'none'}. First shard's tries: {first}. Restore an "
        "older step, or save with more replicas")

  def _blocks(self, final_dir: str, want: RestoreLeaf, stored, shards,
              wanted: RestoreTarget) -> list[np.ndarray]:
    """A leaf's blocks, assembled, their transfers started where the framework can."""
    blocks = [self._assemble(final_dir, want.key_path, region, stored[want.key_path], shards)
              for region, _ in want.blocks]
    if wanted.start is not None:
      wanted.start(want, blocks)
    return blocks

  @staticmethod
  def _assemble(final_dir: str, kp: KeyPath, region, stored: list[ShardRecord], shards
                ) -> np.ndarray:
    """The block ``region`` of a leaf, from the stored shards overlapping it."""
    for record in stored:
      if record.index == region:  # the common case: same sharding as saved, no copy
        return shards[record.id][0]
    out = None
    for record in stored:
      index = record.index
      if not _overlaps(index, region):
        continue
      lo = [max(a, r0) for (a, _), (r0, _) in zip(index, region)]
      hi = [min(b, r1) for (_, b), (_, r1) in zip(index, region)]
      data = shards[record.id][0]
      if out is None:
        out = np.empty(tuple(r1 - r0 for r0, r1 in region), data.dtype)
      src = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, index))
      dst = tuple(slice(l - r0, h - r0) for l, h, (r0, _) in zip(lo, hi, region))
      out[dst] = data[src]
    if out is None:
      raise errors.InvalidArgumentError(f"{final_dir}: no stored shard covers {kp} {region}")
    return out


def _overlaps(index, region) -> bool:
  return all(max(a, r0) < min(b, r1) for (a, b), (r0, r1) in zip(index, region)) or not region

