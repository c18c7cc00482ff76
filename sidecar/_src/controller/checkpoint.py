"""``ctl.checkpointer``: saves that stall the trainer for one copy, restores from RAM or disk.

A save copies every addressable shard once into the arena of the host that owns
its device (replicated shards once), hands the blocks to the sidecars (``staged``)
and returns. The sidecars write their parts in stock Orbax's layout in their own
processes; the controller commits once every host is prepared (``durable``). A
step is listed only after its commit; a crash anywhere before leaves it invisible.

With ``replicas=R`` each sidecar also sends its shards to R peer sidecars once they
are staged (on other slices first, else the next hosts in host order), sidecar to
sidecar (``replicated``). A restore takes each shard from wherever a live copy is:
the arena of the host that staged it, a peer's replica, storage last; it checks
each crc32c and says where the shards came from (:meth:`Checkpointer.last_restore_stats`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from sidecar._src import (
    distributed,
    errors,
    interrupts,
    layout_spec as layout,
    progress as progress_lib,
    shm,
    transfer,
)
from sidecar._src.controller import display, elastic
from sidecar._src.controller.checkpoint_client import CheckpointTransport, StagedShard

log = logging.getLogger(__name__)
KeyPath = tuple[str | int, ...]
# A save is staged in parts of about this many bytes per host, as the copy goes: a
# sidecar starts writing and checksumming one part while the trainer copies the next.
# Smaller parts start the disk sooner but slow the copy more: its DMA and the
# sidecar's work share the memory and the cores (1 GiB here, copied on 2 threads, 24
# saves each, alternating: 128 MiB parts blocked 1.6x a memcpy, durable 0.66-0.70 s;
# 256 MiB 1.5x, 0.73-0.75 s; 512 MiB 1.1-1.2x, 0.70-0.73 s).
STAGE_PART_BYTES = 512 << 20
# The longest wait for a host's writes (prepared) and for the commit that follows.
_LONG_S = 3600.0
# A RAM-tier shard read over gRPC (its host's arena not mapped here) comes in parts of
# at most this many bytes: well under the channel's 256 MiB message limit.
READ_PART_BYTES = 64 << 20
# An abort waits for the host's writer to stop (up to a minute there).
_ABORT_S = 90.0


def key_path(path: Sequence[Any]) -> KeyPath:
  """A jax tree path as Orbax names it: dict keys and attributes as str, indices as int."""
  out = []
  for k in path:
    if isinstance(k, jax.tree_util.SequenceKey):
      out.append(k.idx)
    elif isinstance(k, jax.tree_util.DictKey):
      out.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      out.append(k.name)
    else:
      out.append(str(getattr(k, "key", k)))
  return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
  """Where a step goes: the item directory written, and where it is once committed."""
  directory: str
  step: int
  item: str
  final_item: str
  whole_step: bool  # True: we commit the step (rename); False: Orbax's manager does

  @classmethod
  def for_step(cls, directory: str, step: int) -> Target:
    return cls(directory, step, str(layout.tmp_step_path(directory, step) / layout.ITEM),
               str(pathlib.Path(directory) / str(step) / layout.ITEM), True)

  @classmethod
  def for_orbax_item(cls, item: str, step: int) -> Target:
    """An item directory inside a step that an ``ocp.CheckpointManager`` commits."""
    path = pathlib.Path(item)
    final = path.parent.with_name(path.parent.name.split(layout.TMP_SUFFIX)[0]) / path.name
    return cls(str(path.parent.parent), step, str(path), str(final), False)


@dataclasses.dataclass(frozen=True, slots=True)
class SaveHandle:
  """``staged``: the state is in the arenas (the trainer may change its arrays);
  ``durable``: the step is committed on storage; ``replicated``: every shard has its
  peer copies (``replicas=R``; at once with R=0). All are ``concurrent.futures.Future``s
  that hold the step (None for a skipped save)."""
  step: int
  staged: concurrent.futures.Future
  durable: concurrent.futures.Future
  replicated: concurrent.futures.Future = dataclasses.field(
      default_factory=concurrent.futures.Future)


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreStats:
  """Where the shards of a restore came from, by source: ``"ram:host0"`` (the arena of
  the host that staged it), ``"replica:host1"`` (a peer's replica), ``"storage"``.

  ``shards[source]`` and ``bytes[source]`` count each stored shard once, however many
  target blocks it fills.
  """
  step: int
  seconds: float
  shards: dict[str, int]
  bytes: dict[str, int]

  def summary(self) -> str:
    parts = [f"{n} shards ({shm.format_size(self.bytes[s])}) from {s}"
             for s, n in sorted(self.shards.items())]
    return f"restored step {self.step} in {self.seconds:.2f} s: " + (", ".join(parts) or "nothing")


def replica_peers(slices: dict[int, int], host: int, replicas: int) -> list[int]:
  """The ``replicas`` hosts that keep copies of ``host``'s shards: the next hosts in host
  order (wrapping), those on another slice first."""
  order = sorted(slices)
  i = order.index(host)
  ring = order[i + 1:] + order[:i]
  return ([h for h in ring if slices[h] != slices[host]]
          + [h for h in ring if slices[h] == slices[host]])[:replicas]


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class Checkpointer:
  """Made by ``Controller.checkpointer``; see there.

  It reaches the sidecars only through ``client``, a :class:`CheckpointTransport` (one
  typed method per phase of the ``Checkpoint`` service): the Controller's gRPC
  :class:`~sidecar._src.controller.checkpoint_client.CheckpointClient`, or an in-process
  fake in unit tests.

  Under N trainer processes (one per host) every process makes the same calls. Each
  stages the shards it holds (``replica_id == 0``) into its own sidecar; process 0
  begins each step, gathers every process's prepared and commits once, sweeps and
  deletes old steps; the others learn the outcome through ``peers``.
  """

  def __init__(self, *, directory: str, client: CheckpointTransport,
               hosts: list[int], device_hosts: dict[int, int], max_to_keep: int | None,
               keep_period: int | None, ram_steps: int,
               ram_budget: int | None, if_busy: str, sweep: bool = True,
               local_hosts: Sequence[int] | None = None, peers: distributed.Peers | None = None,
               key: str = "ckpt", replicas: int = 0,
               sidecars: dict[int, dict[str, Any]] | None = None, mapped: Sequence[int] = (),
               replica_bandwidth: int | str | None = None):
    if if_busy not in ("wait", "skip"):
      raise errors.InvalidArgumentError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
    for name, v in (("max_to_keep", max_to_keep), ("keep_period", keep_period)):
      if v is not None and (not isinstance(v, int) or v < 1):
        raise errors.InvalidArgumentError(f"{name} must be None or an int >= 1, got {v!r}")
    if not isinstance(ram_steps, int) or isinstance(ram_steps, bool) or ram_steps < 0:
      raise errors.InvalidArgumentError(f"ram_steps must be an int >= 0, got {ram_steps!r}")
    if ram_budget is not None and (not isinstance(ram_budget, int) or ram_budget < 0):
      raise errors.InvalidArgumentError(
          f"ram_budget must be None or bytes (an int >= 0), got {ram_budget!r}")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
      raise errors.InvalidArgumentError(f"replicas must be an int >= 0, got {replicas!r}")
    if replicas > len(hosts) - 1:  # e.g. an elastic job down to fewer hosts than it planned
      log.warning("replicas=%d, but there are %d hosts: each shard gets %d peer copies",
                  replicas, len(hosts), max(len(hosts) - 1, 0))
      replicas = max(len(hosts) - 1, 0)
    if isinstance(replica_bandwidth, str):
      try:
        replica_bandwidth = shm.parse_size(replica_bandwidth)
      except ValueError as e:
        raise errors.InvalidArgumentError(f"replica_bandwidth: {e}") from None
    if replica_bandwidth is not None and (
        not isinstance(replica_bandwidth, int) or replica_bandwidth < 1):
      raise errors.InvalidArgumentError(
          f"replica_bandwidth must be None or bytes per second (an int >= 1, or a size such "
          f"as '500MiB'), got {replica_bandwidth!r}")
    self._replica_bandwidth = replica_bandwidth
    sidecars = sidecars or {}
    if replicas and set(sidecars) != set(hosts):
      raise errors.InvalidArgumentError(
          f"replicas={replicas} needs every sidecar's address: sidecars names hosts "
          f"{sorted(sidecars)}, the hosts are {sorted(hosts)}")
    self._replicas, self._sidecars, self._mapped = replicas, sidecars, set(mapped)
    slices = {h: int(sidecars.get(h, {}).get("slice_id", 0)) for h in hosts}
    self._placement = {h: replica_peers(slices, h, replicas) for h in hosts}
    self._last_restore: RestoreStats | None = None
    # Absolute here: the sidecars' working directory is not the trainer's.
    self.directory = os.path.abspath(directory)
    self._client = client  # the sidecars, one typed method per phase
    self._hosts, self._device_hosts = hosts, device_hosts
    self._local = list(hosts if local_hosts is None else local_hosts)  # hosts we stage into
    self._peers = peers if peers is not None else distributed.LocalPeers()
    self._key, self._saves, self._restores = key, 0, 0
    self._lead = self._peers.index == 0  # begins, commits, sweeps and deletes, once
    self._max_to_keep, self._keep_period, self._if_busy = max_to_keep, keep_period, if_busy
    opened = [interrupts.wait(f) for f in [
        client.open(h, self.directory, ram_steps=ram_steps, ram_budget=ram_budget,
                    sweep=sweep and self._lead) for h in self._local]]
    # Nobody begins a step before process 0's sweep is over; all list what it lists.
    steps = self._peers.broadcast(f"{key}/open", json.dumps(opened[0]))
    self._steps = list(json.loads(steps))
    self._lock = threading.Lock()
    self._in_flight: SaveHandle | None = None
    self._finisher: threading.Thread | None = None  # the latest save's, until it ends
    self._closed = False

  # ---- save --------------------------------------------------------------

  @interrupts.deferring  # Ctrl-C: the save is aborted and swept, or left to finish
  def save(self, step: int, tree: Any, *, data_state: dict[str, Any] | None = None
           ) -> SaveHandle:
    """Copies ``tree`` into the arenas and returns; the sidecars persist it.

    At most one save is in flight: with ``if_busy="wait"`` this waits for the
    previous one to be durable, with ``"skip"`` it returns a handle whose futures
    hold None and saves nothing.
    """
    self._check_open()
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise errors.InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
    previous = self._in_flight
    busy = previous is not None and not previous.durable.done()
    if self._peers.count > 1:  # every process must take the same decision on the same step
      busy = self._agree_on_save(step, busy)
    if busy:
      if self._if_busy == "skip":
        return _done_handle(step, None)
      if previous is not None:  # busy may be another process's save
        interrupts.wait_done(previous.durable)
    if step in self.all_steps():
      raise errors.InvalidArgumentError(f"step {step} is already saved in {self.directory}")
    handle = self.save_to(Target.for_step(self.directory, step), tree, data_state=data_state)
    self._in_flight = handle
    elastic.at_save(handle)  # under retry(grow=True): hosts back end the attempt here
    return handle

  def _agree_on_save(self, step: int, busy: bool) -> bool:
    """Checks every process saves ``step``; returns whether any has a save in flight."""
    n = self._saves + 1
    gathered = [json.loads(v) for v in self._peers.all_gather(
        f"{self._key}/save/{n}/step", json.dumps({"step": step, "busy": busy}))]
    if len({g["step"] for g in gathered}) > 1:
      raise errors.InvalidArgumentError(
          f"the {self._peers.count} processes disagree on the step of save {n} in "
          f"{self.directory}: " + "; ".join(f"process {p}: step {g['step']}"
                                           for p, g in enumerate(gathered))
          + ". Every process must call save with the same step, in the same order")
    return any(g["busy"] for g in gathered)

  def save_to(self, target: Target, tree: Any, *, data_state: dict[str, Any] | None = None
              ) -> SaveHandle:
    """Copies ``tree`` into the arenas; the sidecars write and commit ``target``."""
    step = target.step
    if data_state is not None:
      try:
        data_json = json.dumps(data_state)
      except TypeError as e:
        raise errors.InvalidArgumentError(f"data_state must be JSON-serialisable: {e}") from None
    else:
      data_json = ""
    self._saves += 1
    key = f"{self._key}/save/{self._saves}"
    handle = SaveHandle(step, concurrent.futures.Future(), concurrent.futures.Future())
    if not self._replicas:
      handle.replicated.set_result(None)
    # Parts go to the sidecars while the copy goes on: their writes overlap the rest
    # of the copy.
    parts: queue.SimpleQueue = queue.SimpleQueue()
    try:
      specs, plan = self._plan(tree)
      self._check_fits(plan)
    except BaseException as e:
      if self._peers.count > 1:  # the other processes wait for this one's part: tell them
        parts.put(e)
        self._start_finisher(handle, target, parts, [], data_json, key).join()
      raise
    leaves = [layout.spec_to_dict(s) for s in specs]
    finisher = self._start_finisher(handle, target, parts, leaves, data_json, key)
    pending: dict[int, list] = {h: [] for h in self._local}
    pending_bytes = dict.fromkeys(self._local, 0)
    try:
      for host, leaf, index, data in plan:  # the one copy the trainer waits for
        interrupts.check()  # Ctrl-C aborts the save (below)
        pending[host].append(StagedShard(leaf, index, self._client.put(host, data)))
        pending_bytes[host] += data.nbytes
        if pending_bytes[host] >= STAGE_PART_BYTES:
          parts.put((host, pending[host], False))
          pending[host], pending_bytes[host] = [], 0
    except BaseException as e:
      pending.clear()  # The traceback keeps this frame: let the blocks go.
      parts.put(e)  # the save is aborted
      finisher.join()  # and its files are gone before the caller can retry the step
      raise
    for host in self._local:
      parts.put((host, pending.pop(host), True))
    return handle

  def _plan(self, tree: Any
            ) -> tuple[list[layout.LeafSpec], list[tuple[int, int, Any, np.ndarray]]]:
    """Leaf specs, and ``(host, leaf, index, data)`` for every shard to copy, each once.

    Of replicated shards only replica 0 is copied, by the process that holds it; leaves
    that are not ``jax.Array``s, by process 0 into its first host.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
      raise errors.InvalidArgumentError("tree has no leaves to save")
    if len(flat) == 1 and not flat[0][0]:
      raise errors.InvalidArgumentError(
          f"save a tree of arrays such as {{'w': w}}, not a bare {type(tree).__name__}: "
          "stock Orbax names each leaf by its path in the tree")
    specs, plan = [], []
    for i, (path, value) in enumerate(flat):
      spec = layout.LeafSpec.from_value(key_path(path), value)
      specs.append(spec)
      if isinstance(value, jax.Array):
        for shard in value.addressable_shards:
          if shard.replica_id != 0:
            continue  # a replica: saved once, by whoever holds replica 0
          index = _index(shard.index, value.shape)
          host = self._device_hosts.get(shard.device.id)
          if host is None:
            raise errors.InvalidArgumentError(
                f"leaf {spec.param_name!r} has a shard on device {shard.device.id}, which no "
                "sidecar host declares (sidecar serve --device-ids)")
          plan.append((host, i, index, np.asarray(shard.data)))
      elif self._lead:
        data = np.asarray(value)
        plan.append((self._local[0], i, tuple((0, n) for n in data.shape), data))
    return specs, plan

  def _check_fits(self, plan) -> None:
    need: dict[int, int] = {}
    for host, _, _, data in plan:
      need[host] = need.get(host, 0) + -(-max(data.nbytes, 1) // shm.PAGE) * shm.PAGE
    free = {s.identity.host_id: (s.arena_size - s.arena_used, s.arena_size)
            for s in self._client.status()}
    short = {h: (n, free[h]) for h, n in need.items() if n > free[h][0]}
    if short:
      detail = "; ".join(f"host {h} needs {shm.format_size(n)}, has {shm.format_size(f)} free "
                         f"of {shm.format_size(size)}" for h, (n, (f, size)) in short.items())
      raise errors.ResourceExhaustedError(
          f"the state does not fit the arenas ({detail}); nothing was copied. Raise the "
          "sidecars' --shm-size (it must hold a save plus the RAM tier and prefetched batches)")

  def _start_finisher(self, handle: SaveHandle, target: Target, parts: queue.SimpleQueue,
                      leaves: list, data_json: str, key: str) -> threading.Thread:
    finisher = threading.Thread(target=self._finish,
                                args=(handle, target, parts, leaves, data_json, key),
                                daemon=True, name=f"sidecar-save-{handle.step}")
    finisher.start()
    self._finisher = finisher
    return finisher

  def _finish(self, handle: SaveHandle, target: Target, parts: queue.SimpleQueue, leaves,
              data_json: str, key: str) -> None:
    """Stages this process's parts, then commits with the others (or aborts)."""
    step, error, sums, replication = handle.step, None, [], None
    try:
      self._begin(target, key)
      self._stage(handle, target, parts, leaves)
      replication = self._start_replication(target)
      if replication is not None and self._peers.count == 1:  # resolved as soon as done
        replication.add_done_callback(
            lambda f: _resolve(handle.replicated, f.exception(), handle.step))
      sums = self._prepared(target)
    except BaseException as e:  # every process must reach the commit's agreement
      error = e.with_traceback(None)  # its frames would hold the staged blocks
    try:
      self._commit(target, key, leaves, sums, data_json, error)
    except BaseException as e:  # the save failed: its futures say why
      if not handle.staged.done():
        handle.staged.set_exception(e)
      handle.durable.set_exception(e)
      self._settle_replication(handle, replication, key, e)
      return
    if target.whole_step:
      self.mark_committed(target)
    handle.durable.set_result(step)
    if target.whole_step:  # Deleting older steps is no part of this save's time.
      self._collect_garbage()
    self._settle_replication(handle, replication, key, None)

  def _start_replication(self, target: Target) -> concurrent.futures.Future | None:
    """Each local host sends its staged shards to its peers (in the sidecars); returns a
    future that holds when all of them hold their copies."""
    if not self._replicas:
      return None
    futures = []
    for h in self._local:
      peers = [dict(self._sidecars[p], host_id=p) for p in self._placement[h]]
      futures.append(self._client.replicate(h, target.final_item, peers,
                                            bandwidth=self._replica_bandwidth, timeout=_LONG_S))
    out: concurrent.futures.Future = concurrent.futures.Future()
    t0 = time.perf_counter()

    def done(_):
      if out.done() or not all(f.done() for f in futures):
        return
      failed = [f.exception() for f in futures if f.exception() is not None]
      try:
        if failed:
          out.set_exception(failed[0])
        else:
          results = [f.result() for f in futures]
          out.set_result(results)
          log.info("step %d: %s replicated to %d peers per host in %.2f s", target.step,
                   shm.format_size(sum(r["bytes"] for r in results)), self._replicas,
                   time.perf_counter() - t0)
      except concurrent.futures.InvalidStateError:
        pass  # two last callbacks raced

    for f in futures:
      f.add_done_callback(done)
    return out

  def _settle_replication(self, handle: SaveHandle, replication, key: str,
                          error: BaseException | None) -> None:
    """Resolves ``handle.replicated``: with this process's replication, and under N
    processes once every process's is (or failed)."""
    if handle.replicated.done():
      return
    mine: BaseException | None = error
    if mine is None and replication is not None:
      mine = replication.exception()  # waits for it
    if mine is None and replication is None:
      mine = errors.InvalidArgumentError(f"step {handle.step} was not replicated")
    if self._peers.count > 1:
      self._peers.publish(f"{key}/replicated", _describe(mine))
      for p in range(self._peers.count):
        if mine is not None:
          break
        try:
          theirs = self._peers.read(f"{key}/replicated", p, timeout=distributed.sync_timeout())
        except errors.SidecarError as e:
          theirs = _describe(e)
        if theirs:
          mine = errors.HostLostError(f"process {p} could not replicate step {handle.step}: "
                                      f"{theirs}")
    _resolve(handle.replicated, mine, handle.step)

  def _begin(self, target: Target, key: str) -> None:
    """Process 0 creates the step's tmp directory; the others wait until it has."""
    if not self._lead:
      failed = self._peers.read(f"{key}/begun", 0, timeout=distributed.sync_timeout())
      if failed:
        raise errors.InvalidArgumentError(
            f"process 0 could not begin step {target.step}: {failed}")
      return
    try:
      if target.whole_step:
        self._client.begin(self._local[0], self.directory, target.step).result()
    except BaseException as e:
      self._peers.publish(f"{key}/begun", _describe(e))
      raise
    self._peers.publish(f"{key}/begun", "")

  def _stage(self, handle: SaveHandle, target: Target, parts: queue.SimpleQueue, leaves
             ) -> None:
    """Hands this process's parts to its sidecars as they come."""
    step = handle.step
    last: dict[int, concurrent.futures.Future] = {}  # per host, its latest stage call
    closed = 0
    try:
      while closed < len(self._local):
        part = parts.get()  # (host, shards, last); no other local holds the shards, as
        if isinstance(part, BaseException):  # the raise would keep them in its frame
          raise part
        host, final = part[0], part[2]
        if host in last:
          last[host].result()  # a host's parts arrive in order
        specs = [] if host in last else leaves  # the first part carries the leaves
        last[host] = self._client.stage(host, directory=self.directory, step=step,
                                        item=target.item, final_item=target.final_item,
                                        leaves=specs, shards=part[1], last=final)
        closed += final
    except BaseException:
      # The abort that follows must reach each sidecar after its last stage call: one
      # arriving later would stage the step anew, and hold its blocks until it times out.
      concurrent.futures.wait(list(last.values()))
      raise
    for f in last.values():
      f.result()
    handle.staged.set_result(step)

  def _prepared(self, target: Target) -> list[dict]:
    """Waits for this process's sidecars to write their parts; returns their checksums."""
    prepared = [f.result() for f in [self._client.prepared(h, target.final_item, timeout=_LONG_S)
                                     for h in self._local]]
    return [c for host_sums in prepared for c in host_sums]

  def _commit(self, target: Target, key: str, leaves, sums: list[dict], data_json: str,
              error: BaseException | None) -> None:
    """Process 0 gathers every process's prepared, then commits once or aborts.

    Every process gets here once per save, failed or not, so nobody waits for one
    that gave up. The save fails in every process if it failed in any.
    """
    mine = json.dumps({"error": _describe(error)} if error is not None else {"ok": sums})
    if not self._lead:
      self._peers.publish(f"{key}/prepared", mine)
      failed = self._peers.read(f"{key}/outcome", 0, timeout=_LONG_S)
      if error is not None:
        raise error
      if failed:
        raise errors.InvalidArgumentError(f"the save of step {target.step} failed: {failed}")
      return
    try:
      gathered = [json.loads(v) for v in self._peers.all_gather(
          f"{key}/prepared", mine, timeout=_LONG_S)]
      failures = [f"process {p}: {g['error']}" for p, g in enumerate(gathered) if "error" in g]
      if error is not None:
        raise error
      if failures:
        raise errors.InvalidArgumentError(
            f"the save of step {target.step} failed in {'; '.join(failures)}")
      checksums = [c for g in gathered for c in g["ok"]]
      self._client.commit(self._local[0], item=target.item, step=target.step,
                          num_hosts=len(self._hosts), leaves=leaves, checksums=checksums,
                          data_state_json=data_json, whole_step=target.whole_step,
                          replicas={h: p for h, p in self._placement.items() if p} or None,
                          timeout=_LONG_S).result()
    except BaseException as e:
      self._abort(target)  # before anyone fails: a retry must not race the cleanup
      self._peers.publish(f"{key}/outcome", _describe(e))
      raise
    self._peers.publish(f"{key}/outcome", "")

  def _abort(self, target: Target) -> None:
    """Drops a failed save from every sidecar that answers, then its uncommitted files.

    A host that does not answer keeps its part only until its writer gives up on the
    step (``STAGE_TIMEOUT_S`` there), and the next ``open()`` sweeps the tmp directory.
    """
    done = self._on_each(
        lambda h: self._client.abort(h, target.item, target.final_item, timeout=_ABORT_S),
        hosts=self._hosts, what=f"abort step {target.step}")
    if target.whole_step and done:  # Every host is done with the step: its tmp directory goes.
      tmp = str(pathlib.Path(target.item).parent)
      self._on_each(lambda h: self._client.abort(h, tmp, target.final_item, timeout=_ABORT_S),
                    hosts=done, what=f"remove step {target.step}'s tmp files")

  @staticmethod
  def _on_each(start: Callable[[int], concurrent.futures.Future], *, hosts: Sequence[int],
               what: str) -> list[int]:
    """Runs ``start(host)`` on each host at once; returns those that did it, logs the others."""
    futures: dict[int, concurrent.futures.Future] = {}
    for h in hosts:
      try:
        futures[h] = start(h)
      except errors.SidecarError as e:  # a host known lost: nothing to call
        log.warning("could not %s on host %d: %s", what, h, e)
    ok = []
    for h, future in futures.items():
      try:
        future.result()
        ok.append(h)
      except errors.SidecarError as e:
        log.warning("could not %s on host %d: %s", what, h, e)
    return ok

  def mark_committed(self, target: Target) -> None:
    """Tells the RAM tiers the step is visible; lists it."""
    # Durable all the same where a host does not answer: a lost host's RAM tier is gone anyway.
    self._on_each(lambda h: self._client.committed(h, target.final_item), hosts=self._local,
                  what=f"mark step {target.step} committed in the RAM tier")
    if target.whole_step:
      with self._lock:
        self._steps = sorted(set(self._steps) | {target.step})

  def _collect_garbage(self) -> None:
    """Deletes the steps ``max_to_keep`` and ``keep_period`` no longer keep."""
    if self._max_to_keep is None:
      return
    with self._lock:
      steps = list(self._steps)
    keep = set(steps[-self._max_to_keep:])
    if self._keep_period:
      keep |= {s for s in steps if s % self._keep_period == 0}
    for s in steps:
      if s in keep:
        continue
      with self._lock:  # unlisted first: a restore must not pick a step being deleted
        self._steps = [t for t in self._steps if t != s]
      try:  # out of the RAM tiers too (own shards and replicas), where a budget kept it
        for f in [self._client.forget(h, self.directory, s) for h in self._local]:
          f.result()
      except errors.SidecarError:
        pass  # a lost host's RAM tier is gone anyway
      if not self._lead:
        continue  # process 0 deletes it
      try:
        self._client.delete(self._local[0], self.directory, s).result()
      except errors.SidecarError as e:  # the step is durable all the same; retried next save
        log.warning("could not delete step %d of %s: %s", s, self.directory, e)
        with self._lock:
          self._steps = sorted(set(self._steps) | {s})
        return

  # ---- restore -----------------------------------------------------------

  @interrupts.deferring  # Ctrl-C: the reads in flight are dropped, their blocks go back
  def restore(self, step: int | None = None, *, target: Any,
              progress: Callable[[str], None] | bool | None = None) -> Any:
    """Restores ``step`` (default: the latest) onto the shardings of ``target``.

    ``target`` is a pytree of ``jax.ShapeDtypeStruct``s with shardings, or of concrete
    arrays (their shardings are used). Takes each shard from a live copy: the arena
    of the host that staged it, else a peer's replica (``replicas=R``), else storage,
    checking its crc32c; a copy that fails its check or whose host is gone falls back
    to the next. Reshards when the target mesh differs from the one saved. Where the
    shards came from: :meth:`last_restore_stats`, and a line at INFO.
    With ``progress`` (``print``, say), a restore past a second reports its progress; by
    default (None) on a tqdm line where one is seen (a terminal, a notebook).

    Raises:
      ShardsLostError: some shard has no live copy and no valid stored one.
    """
    self._check_open()
    step = self._pick(step)
    if self._peers.count > 1:  # process 0 decides which step; every process restores it
      self._restores += 1
      step = int(self._peers.broadcast(f"{self._key}/restore/{self._restores}",
                                       str(step) if self._lead else None))
    with progress_lib.lines(progress, f"restoring step {step}") as report:
      return self.restore_from(Target.for_step(self.directory, step).final_item, step, target,
                               progress=report)

  def last_restore_stats(self) -> RestoreStats | None:
    """Where the shards of this process's latest successful restore came from."""
    return self._last_restore

  def restore_from(self, final_item: str, step: int, target: Any, *,
                   progress: Callable[[str], None] | None = None) -> Any:
    """Restores the committed item at ``final_item`` onto ``target``'s shardings."""
    t0, done, last = time.perf_counter(), 0, [time.perf_counter()]
    manifest = interrupts.wait(self._client.info(self._local[0], final_item))
    saved = {tuple(d["key_path"]): d for d in manifest.leaves}
    stored: dict[KeyPath, list[tuple[tuple[tuple[int, int], ...], int]]] = {}
    owners: dict[tuple[KeyPath, tuple], int] = {}  # which host staged each shard, if known
    for c in manifest.shards:
      kp, index = tuple(c["key_path"]), tuple(tuple(i) for i in c["index"])
      stored.setdefault(kp, []).append((index, c["crc32c"]))
      if c.get("host") is not None:
        owners[(kp, index)] = int(c["host"])
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    for path, want in flat:
      self._check_leaf(key_path(path), want, saved, step)
    held, gone = self._holdings(final_item)
    reads = self._read_all(final_item, flat, stored, held)
    shards, lost = {}, []
    try:
      for k, f in reads.items():
        try:
          shards[k] = interrupts.wait(f)
        except errors.SidecarError as e:
          lost.append((k, e))
        if progress is not None and time.perf_counter() - last[0] >= 1.0:
          last[0] = time.perf_counter()
          progress(f"restoring step {step}: {len(shards)} of {len(reads)} shards read")
    except KeyboardInterrupt:
      reads.clear()  # the traceback keeps this frame: let the blocks go
      shards.clear()
      raise
    if lost:
      placed = dict(manifest.replicas)
      raise self._lost(step, lost, owners, placed, gone)
    out = []
    for path, want in flat:
      kp = key_path(path)
      out.append(self._restore_leaf(final_item, kp, want, stored[kp], shards))
      done += out[-1].nbytes if hasattr(out[-1], "nbytes") else 0
      now = time.perf_counter()
      if progress is not None and now - last[0] >= 1.0:
        last[0] = now
        progress(f"restoring step {step}: {shm.format_size(done)} "
                 f"({done / (now - t0) / 1e9:.2f} GB/s)")
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for data, source in shards.values():
      counts[source] = counts.get(source, 0) + 1
      sizes[source] = sizes.get(source, 0) + data.nbytes
    self._last_restore = RestoreStats(step, time.perf_counter() - t0, counts, sizes)
    log.info("%s of %s", self._last_restore.summary(), self.directory)
    return jax.tree_util.tree_unflatten(treedef, out)

  def data_state(self, step: int | None = None) -> dict[str, Any] | None:
    """The data position saved with ``step`` (default: the latest), or None."""
    step = self._pick(step)
    return interrupts.wait(self._client.info(
        self._local[0], Target.for_step(self.directory, step).final_item)).data_state

  def _pick(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise errors.InvalidArgumentError(f"no committed step in {self.directory} to restore")
      return steps[-1]
    if step not in steps:
      raise errors.InvalidArgumentError(
          f"step {step} does not exist in {self.directory}; committed steps: {steps or 'none'}")
    return step

  @staticmethod
  def _check_leaf(kp: KeyPath, want: Any, saved: dict, step: int) -> None:
    name = ".".join(map(str, kp))
    if kp not in saved:
      raise errors.InvalidArgumentError(
          f"target leaf {name!r} is not in step {step}; it has {sorted('.'.join(map(str, k)) for k in saved)}")
    d = saved[kp]
    shape, dtype = tuple(np.shape(want)), np.dtype(getattr(want, "dtype", np.asarray(want).dtype))
    if shape != tuple(d["shape"]) or dtype.name != d["dtype"]:
      raise errors.InvalidArgumentError(
          f"target leaf {name!r} is {dtype.name}{list(shape)} but step {step} saved "
          f"{d['dtype']}{d['shape']}")

  def _holdings(self, final_item: str
                ) -> tuple[dict[tuple[KeyPath, tuple], list[tuple[int, str]]], list[int]]:
    """Every live RAM copy of each shard, as ``(host, tier)``, and the hosts that did
    not answer. Tier ``ram``: the arena of the host that staged it; ``replica``: a peer's."""
    where: dict[tuple[KeyPath, tuple], list[tuple[int, str]]] = {}
    gone = []
    hosts = self._hosts if self._replicas or self._peers.count == 1 else self._local
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
      copies = [(kp, index, "ram") for kp, index in held.own.get(final_item, [])]
      copies += [(kp, index, "replica") for shards in held.replicas.get(final_item, {}).values()
                 for kp, index in shards]
      for kp, index, tier in copies:
        where.setdefault((tuple(kp), tuple(tuple(i) for i in index)), []).append((h, tier))
    return where, gone

  def _sources(self, key: tuple[KeyPath, tuple], held, host: int) -> list[tuple[int, str]]:
    """Where to read a shard, in order: RAM copies (the target block's host, then the
    hosts whose arenas this process maps, then the rest; own copies before replicas),
    then storage through the block's host or this process's."""
    def rank(copy: tuple[int, str]) -> tuple:
      h, tier = copy
      return (h != host, h not in self._mapped, tier != "ram", h)
    tries = sorted(held.get(key, []), key=rank)
    return tries + [(h, "disk") for h in dict.fromkeys([host, *self._local])]

  def _regions(self, want: Any) -> list[tuple[Any, tuple, int]]:
    """``(device or None, region, host)`` of each block of a target leaf to fill."""
    sharding, shape = getattr(want, "sharding", None), tuple(np.shape(want))
    if sharding is None:  # numpy or scalar leaf
      return [(None, tuple((0, n) for n in shape), self._local[0])]
    return [(d, _index(index, shape), self._device_hosts.get(d.id, self._local[0]))
            for d, index in sharding.addressable_devices_indices_map(shape).items()]

  def _read_all(self, item: str, flat, stored, held) -> dict:
    """Starts every stored-shard read a restore needs, all at once: they overlap.

    Each is a future of ``(data, source)`` that tries the shard's sources in turn.
    """
    reads = {}
    for path, want in flat:
      kp = key_path(path)
      for _, region, host in self._regions(want):
        for index, crc in stored[kp]:
          if (kp, index) in reads or not _overlaps(index, region):
            continue
          reads[(kp, index)] = self._read_shard(item, kp, index, crc,
                                                self._sources((kp, index), held, host),
                                                np.dtype(want.dtype))
    return reads

  def _read_shard(self, item: str, kp: KeyPath, index, crc: int | None,
                  sources: list[tuple[int, str]], dtype: np.dtype) -> concurrent.futures.Future:
    """A future of ``(data, source)``: the first source whose copy reads and checks."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    failures: list[str] = []

    def attempt(i: int) -> None:
      if i == len(sources):
        out.set_exception(errors.ShardsLostError("; ".join(failures)))
        return
      host, tier = sources[i]
      label = "storage" if tier == "disk" else f"{tier}:host{host}"

      def done(f: concurrent.futures.Future) -> None:
        try:
          data = f.result()
        except errors.SidecarError as e:
          failures.append(f"{label} (host {host}): {str(e).splitlines()[0]}")
          attempt(i + 1)
          return
        out.set_result((data, label))

      try:
        shape = tuple(b - a for a, b in index)
        nbytes = math.prod(shape) * dtype.itemsize
        if tier != "disk" and host not in self._mapped and nbytes > READ_PART_BYTES:
          self._read_parts(item, kp, index, crc, tier, host, shape, dtype).add_done_callback(done)
        else:
          self._client.read(host, item, (kp, index), crc32c=crc,
                            tier=tier).add_done_callback(done)
      except errors.SidecarError as e:
        failures.append(f"{label} (host {host}): {e}")
        attempt(i + 1)

    attempt(0)
    return out

  def _read_parts(self, item: str, kp: KeyPath, index, crc: int | None, tier: str, host: int,
                  shape: tuple[int, ...], dtype: np.dtype) -> concurrent.futures.Future:
    """A future of a RAM-tier shard read from ``host`` over gRPC in parts of at most
    READ_PART_BYTES, assembled here (the host checks the whole shard's crc32c, with the
    first part)."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    data = np.empty(shape, dtype)
    flat = data.reshape(-1).view(np.uint8)
    parts = [(o, min(READ_PART_BYTES, flat.nbytes - o))
             for o in range(0, flat.nbytes, READ_PART_BYTES)]
    left = [len(parts)]
    lock = threading.Lock()

    def done(offset: int, f: concurrent.futures.Future) -> None:
      error = f.exception()
      if error is None:
        part = f.result()
        flat[offset:offset + part.nbytes] = part
      with lock:  # the first failure fails the shard; else the last part completes it
        left[0] -= 1
        if out.done():
          return
        if error is not None:
          out.set_exception(error)
        elif left[0] == 0:
          out.set_result(data)

    for offset, nbytes in parts:
      # Only the first part asks for the check: the host checks the whole shard once, and
      # its failure fails the shard (the parts all go at once, so each would check it).
      future = self._client.read(host, item, (kp, index), crc32c=crc if offset == 0 else None,
                                 tier=tier, part=(offset, nbytes))
      future.add_done_callback(functools.partial(done, offset))
    return out

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
        f"older step ({self.all_steps()}), or save with more replicas")

  def _restore_leaf(self, item: str, kp: KeyPath, want: Any, stored, shards) -> Any:
    sharding, shape = getattr(want, "sharding", None), tuple(np.shape(want))
    blocks = [(d, self._assemble(item, kp, region, stored, shards))
              for d, region, _ in self._regions(want)]
    if sharding is None:
      data = blocks[0][1]
      return data if shape else data[()]
    return transfer.global_array(shape, sharding, [b for _, b in blocks],
                                   [d for d, _ in blocks])

  @staticmethod
  def _assemble(item: str, kp: KeyPath, region, stored, shards) -> np.ndarray:
    """The block ``region`` of a leaf, from the stored shards overlapping it."""
    for index, _ in stored:
      if index == region:  # the common case: same sharding as saved, no copy
        return shards[(kp, index)][0]
    out = None
    for index, _ in stored:
      if not _overlaps(index, region):
        continue
      lo = [max(a, r0) for (a, _), (r0, _) in zip(index, region)]
      hi = [min(b, r1) for (_, b), (_, r1) in zip(index, region)]
      data = shards[(kp, index)][0]
      if out is None:
        out = np.empty(tuple(r1 - r0 for r0, r1 in region), data.dtype)
      src = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, index))
      dst = tuple(slice(l - r0, h - r0) for l, h, (r0, _) in zip(lo, hi, region))
      out[dst] = data[src]
    if out is None:
      raise errors.InvalidArgumentError(f"{item}: no stored shard covers {kp} {region}")
    return out

  # ---- listing and lifecycle ---------------------------------------------

  def all_steps(self) -> list[int]:
    with self._lock:
      return list(self._steps)

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  @interrupts.deferring  # Ctrl-C stops the wait; the save goes on
  def wait(self, *, progress: Callable[[str], None] | bool | None = None) -> None:
    """Waits until the save in flight (if any) is durable, and the older steps it
    makes ``max_to_keep`` drop are deleted (and, with replicas, until its replication
    has ended, done or failed: ``handle.replicated`` says which); raises its error.

    With ``progress`` (``print``, say), a wait longer than a second reports the bytes
    the sidecars have made durable, and the rate, once a second; by default (None) on
    a tqdm line where one is seen (a terminal, a notebook); ``False``: never.
    """
    handle = self._in_flight
    if handle is None:
      return
    with progress_lib.lines(progress, f"saving step {handle.step}") as report:
      while report is not None and not handle.durable.done():
        try:
          interrupts.wait_done(handle.durable, timeout=1.0)
        except concurrent.futures.TimeoutError:
          report(self._progress_line(handle.step))
    interrupts.wait_done(handle.durable)
    self._join_finisher()  # and the older steps max_to_keep drops are gone
    handle.durable.result()

  def _join_finisher(self) -> None:
    finisher = self._finisher
    if finisher is not None and finisher is not threading.current_thread():
      while finisher.is_alive():  # a join Ctrl-C can stop
        finisher.join(interrupts.POLL_S)
        interrupts.check()

  def _progress_line(self, step: int) -> str:
    done = total = 0
    seconds = 0.0
    for s in self._client.status():
      for c in s.checkpoints:
        if c.directory == self.directory and step in c.writing:
          done, total = done + c.written_bytes, total + c.total_bytes
          seconds = max(seconds, c.writing_s)
    rate = done / seconds / 1e9 if seconds else 0.0
    return (f"saving step {step}: {shm.format_size(done)} of {shm.format_size(total)} "
            f"durable ({rate:.2f} GB/s)")

  def _check_open(self) -> None:
    if self._closed:
      raise errors.ClosedError("this checkpointer is closed")

  @interrupts.deferring
  def close(self) -> None:
    """Waits for the save in flight, then closes; idempotent."""
    if self._closed:
      return
    try:
      self._join_finisher()
    finally:
      self._closed = True

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return display.text_block("sidecar checkpointer", *self._display())

  def _repr_html_(self) -> str:
    facts, table = self._display(html=True)
    return display.html_block("sidecar checkpointer", facts, table)

  def _display(self, html: bool = False) -> tuple[list[tuple[str, str]], str]:
    """Facts (no call), and each host's tiers for this directory (one bounded Status)."""
    facts = display.checkpointer_facts(self.directory, self.all_steps(), self._in_flight,
                                       self._last_restore, self._closed)
    if self._closed:
      return facts, ""
    try:
      rows = display.tier_rows(self._client.status(timeout=display.STATUS_TIMEOUT_S),
                               self.directory)
    except Exception as e:  # a display never raises
      rows = [["-", display.error_text(e), "", "", ""]]
    make = display.html_table if html else display.text_table
    return facts, make(display.TIER_HEADER, rows)


def _overlaps(index, region) -> bool:
  return all(max(a, r0) < min(b, r1) for (a, b), (r0, r1) in zip(index, region)) or not region


def _resolve(future: concurrent.futures.Future, error: BaseException | None, value: Any
             ) -> None:
  """Sets ``future`` unless it is set already (a callback and a thread may race)."""
  try:
    if error is not None:
      future.set_exception(error)
    else:
      future.set_result(value)
  except concurrent.futures.InvalidStateError:
    pass


def _describe(e: BaseException | None) -> str:
  return f"{type(e).__name__}: {e}"[:2000] if e is not None else ""


def _done_handle(step: int, value: Any) -> SaveHandle:
  staged, durable = concurrent.futures.Future(), concurrent.futures.Future()
  staged.set_result(value)
  durable.set_result(value)
  replicated: concurrent.futures.Future = concurrent.futures.Future()
  replicated.set_result(value)
  return SaveHandle(step, staged, durable, replicated)
