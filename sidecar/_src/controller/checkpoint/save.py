"""The save protocol, once for every framework and format.

:class:`SaveProtocol` is the format-neutral save of one step on the sidecars, phase by
phase, each on the hosts it is given: begin (the tmp directory), stage a host's parts,
prepared (each host's checksums once written), commit once or abort everywhere, mark
committed, replicate. Who calls each phase, and how the trainer processes agree between
them, is pluggable: :class:`SaveCoordinator` (JAX's and the numpy core's checkpointer)
agrees through the processes' key-value store (``controller/peers.Peers``); PyTorch's
``torch/storage.StorageWriter`` through DCP's coordinator rank (DCP's own gather and
scatter around its ``prepare_global_plan`` and ``finish``).

With :class:`SaveCoordinator` a save copies every addressable shard once into the arena
of the host that owns its device (replicated shards once), hands the blocks to the
sidecars in parts (``staged``) and returns; a shard still on its way from an accelerator
(a ``HostCopy``) is copied by a stager thread once it has landed, after the save
returned. A finisher thread then begins the step (process 0), stages the parts, starts
the peer replication, waits for every host's writes (prepared) and commits once
(process 0), or aborts everywhere (``durable``, ``replicated``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import spec as spec_lib
from sidecar._src.ckptfmt.records import ReplicaTarget, Replicated, ShardChecksum, StagedShard
from sidecar._src.controller.checkpoint.client import CheckpointTransport, CommitPart, StagePart
from sidecar._src.controller.checkpoint.staging import Parts, stage_late
from sidecar._src.controller.checkpoint.target import SaveHandle, Target
from sidecar._src.controller.framework import Framework, HostCopy, SaveShard
from sidecar._src.controller.peers import Peers, sync_timeout
from sidecar._src.core import errors, interrupts
from sidecar._src.wire import codec, protocol

# The checkpointer's one logger, whichever of its modules logs.
log = logging.getLogger(__name__)
# The longest wait for a host's writes (prepared) and for the commit that follows.
_LONG_S = 3600.0
# An abort waits for the host's writer to stop (up to a minute there).
_ABORT_S = 90.0


class SaveProtocol:
  """The phases of one step's save on the sidecars, each on the hosts it is given.

  Format-neutral: a format's own part of a request travels as a typed value
  (``client.StagePart``, ``client.CommitPart``: ``ckptfmt/dcp``'s; none for stock Orbax's
  layout), never as a branch here. The caller agrees with the other trainer processes
  between phases.

  Args:
    client: the sidecars.
    directory: the checkpoint directory (absolute): where the steps are.
    format: the format's name (``""``: stock Orbax's layout; ``"dcp"``).
    writers: the processes that stage into each host, where several share one (each
      sends its own last part; the host's step is whole once all of them have).
  """

  def __init__(self, *, client: CheckpointTransport, directory: str, format: str = "",
               writers: Mapping[int, Sequence[int]] | None = None):
    self.client, self.directory, self.format = client, directory, format
    self._writers = dict(writers or {})

  def begin(self, host: int, path: str, step: int) -> str:
    """Makes the step's tmp directory on ``host``; returns it. ``path``: the checkpoint
    directory, or a one-directory checkpoint's own path (its tmp one beside it)."""
    fmt = {"format": self.format} if self.format else {}
    return self.client.begin(host, path, step, **fmt).result()

  def stage(self, target: Target, parts: queue.SimpleQueue, *, hosts: Sequence[int],
            leaves: Sequence[spec_lib.LeafSpec] = (), part: StagePart | None = None,
            rest: StagePart | None = None) -> None:
    """Hands the parts ``parts`` holds (``(host, shards, last)``, as ``staging.Parts`` puts
    them; an exception aborts) to their sidecars as they come, until each of ``hosts``
    had its last. A host's first part carries ``leaves`` and the format's ``part``, its
    later ones ``rest``."""
    last: dict[int, concurrent.futures.Future] = {}  # per host, its latest stage call
    closed = 0
    try:
      while closed < len(hosts):
        got = parts.get()  # (host, shards, last); no other local holds the shards, as
        if isinstance(got, BaseException):  # the raise would keep them in its frame
          raise got
        host, final = got[0], got[2]
        first = host not in last
        if not first:
          last[host].result()  # a host's parts arrive in order
        now = part if first else rest
        fmt = {} if now is None else {"part": now}
        last[host] = self.client.stage(host, directory=self.directory, step=target.step,
                                       tmp_dir=target.tmp_dir, final_dir=target.final_dir,
                                       leaves=list(leaves) if first else [], shards=got[1],
                                       last=final, writers=len(self._writers.get(host, ())) or 1, **fmt)
        closed += final
    except BaseException:
      # The abort that follows must reach each sidecar after its last stage call: one
      # arriving later would stage the step anew, and hold its blocks until it times out.
      concurrent.futures.wait(list(last.values()))
      raise
    for f in last.values():
      f.result()

  def stage_copies(self, target: Target, host: int, arrays: list[np.ndarray],
                   indexes: Sequence[spec_lib.Index], refs: Sequence[codec.ArenaRef | None], *,
                   part: StagePart | None = None, rest: StagePart | None = None,
                   threads: int | None = None) -> None:
    """Stages this process's shards on ``host``: each of ``arrays`` (the shard of leaf
    ``i`` at ``indexes[i]``) copied into the host's arena where ``refs`` has no block of it
    (the blocks allocated in one request), and handed to the sidecar in parts of about
    ``STAGE_PART_BYTES`` as the copy goes, by a stager thread of this call. On a failure
    (Ctrl-C too, between two copies) the host's part is dropped again, and it raises.
    ``arrays`` is emptied: its blocks are the sidecar's once staged."""
    parts: queue.SimpleQueue = queue.SimpleQueue()
    staging = Parts([host], parts)
    failed: list[BaseException] = []

    def stage() -> None:
      try:
        self.stage(target, parts, hosts=[host], part=part, rest=rest)
      except BaseException as e:
        failed.append(e.with_traceback(None))  # its frames would hold the blocks

    stager = threading.Thread(target=stage, daemon=True, name=f"sidecar-stage-{target.step}")
    stager.start()
    try:
      fresh = [i for i, r in enumerate(refs) if r is None]
      blocks = dict(zip(fresh, self.client.empty_like(host, [arrays[i] for i in fresh])))
      for i, (array, index) in enumerate(zip(arrays, indexes)):
        interrupts.check()  # Ctrl-C aborts the save
        ref = refs[i]
        if i in blocks:
          block, ref = blocks.pop(i)
          shm.copy(block, array, threads=threads)  # the one copy the trainer waits for
          array = block
        staging.add(host, StagedShard(i, index, array, ref), array.nbytes)
        arrays[i] = array
      staging.close()
    except BaseException as e:
      staging.fail(e.with_traceback(None))
      failed.append(e)
    finally:
      arrays.clear()
      stager.join()
    if failed:
      self.abort(target, [host])
      raise failed[0]

  def prepared(self, target: Target, hosts: Sequence[int]) -> list[ShardChecksum]:
    """Waits for ``hosts`` to write their parts; returns their checksums."""
    prepared = [f.result() for f in [self.client.prepared(h, target.final_dir, timeout=_LONG_S)
                                     for h in hosts]]
    return [c for host_sums in prepared for c in host_sums]

  def commit(self, host: int, target: Target, *, num_hosts: int,
             checksums: Sequence[ShardChecksum], leaves: Sequence[spec_lib.LeafSpec] = (),
             data_state_json: str = "", replicas: Mapping[int, Sequence[int]] | None = None,
             part: CommitPart | None = None) -> str:
    """``host`` commits the step (every host prepared); returns the committed directory."""
    fmt = {} if part is None else {"part": part}
    return self.client.commit(host, tmp_dir=target.tmp_dir, step=target.step,
                              num_hosts=num_hosts, leaves=list(leaves), checksums=checksums,
                              data_state_json=data_state_json, whole_step=target.whole_step,
                              replicas={h: p for h, p in (replicas or {}).items() if p} or None,
                              timeout=_LONG_S, **fmt).result()

  def abort(self, target: Target, hosts: Sequence[int]) -> None:
    """Drops a failed save from every sidecar that answers, then its uncommitted files.

    A host that does not answer keeps its part only until its writer gives up on the
    step (``STAGE_TIMEOUT_S`` there), and the next ``open()`` sweeps the tmp directory.
    """
    done = on_each(
        lambda h: self.client.abort(h, target.tmp_dir, target.final_dir, timeout=_ABORT_S),
        hosts=hosts, what=f"abort step {target.step}")
    tmp = target.tmp_step
    if target.whole_step and done and tmp and tmp != target.tmp_dir:
      # Every host is done with the step: its tmp directory goes.
      on_each(lambda h: self.client.abort(h, tmp, target.final_dir, timeout=_ABORT_S),
              hosts=done, what=f"remove step {target.step}'s tmp files")

  def mark_committed(self, target: Target, hosts: Sequence[int], manifest_json: str = ""
                     ) -> None:
    """Tells ``hosts``' RAM tiers the step is visible (``manifest_json``: its manifest,
    where the committing sidecar alone wrote it: a DCP step's)."""
    # Durable all the same where a host does not answer: a lost host's RAM tier is gone anyway.
    extra = {"manifest_json": manifest_json} if manifest_json else {}
    on_each(lambda h: self.client.committed(h, target.final_dir, **extra), hosts=hosts,
            what=f"mark step {target.step} committed in the RAM tier")

  def start_replication(self, target: Target, placement: Mapping[int, Sequence[int]],
                        sidecars: Mapping[int, Mapping[str, Any]], *,
                        bandwidth: int | None) -> concurrent.futures.Future | None:
    """Each host of ``placement`` sends its staged shards to its replica hosts (sidecar
    to sidecar, ``sidecars`` their records); returns a future of their
    :class:`Replicated` once all of them hold their copies, or None where no host has
    any."""
    placement = {h: p for h, p in placement.items() if p}
    if not placement:
      return None
    futures = [self.client.replicate(h, target.final_dir,
                                     [_replica_target(p, sidecars[p]) for p in to],
                                     bandwidth=bandwidth, timeout=_LONG_S)
               for h, to in placement.items()]
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
          results: list[Replicated] = [f.result() for f in futures]
          out.set_result(results)
          log.info("step %d: %s replicated from %d hosts in %.2f s", target.step,
                   shm.format_size(sum(r.nbytes for r in results)), len(futures),
                   time.perf_counter() - t0)
      except concurrent.futures.InvalidStateError:
        pass  # two last callbacks raced

    for f in futures:
      f.add_done_callback(done)
    return out


def on_each(start: Callable[[int], concurrent.futures.Future], *, hosts: Sequence[int],
            what: str) -> list[int]:
  """Runs ``start(host)`` on each host at once; returns those that did it, logs the others."""
  futures: dict[int, concurrent.futures.Future] = {}
  for h in hosts:
    try:
      futures[h] = start(h)
    except errors.SidecarError as e:  # a host known lost: nothing to call
      # The text, not the error: a handler that keeps records (pytest's, a MemoryHandler)
      # would keep its traceback's frames, and their arrays' arena blocks, alive.
      log.warning("could not %s on host %d: %s", what, h, str(e))
  ok = []
  for h, future in futures.items():
    try:
      future.result()
      ok.append(h)
    except errors.SidecarError as e:
      log.warning("could not %s on host %d: %s", what, h, str(e))
  return ok


def agree_on_save(peers: Peers, key: str, step: int, busy: bool, *, what: str) -> bool:
  """Checks every process saves ``step`` (raises in every process if not); returns
  whether any process has a save in flight, so that all take the same busy decision
  (``if_busy``: wait for it, or skip this save)."""
  if peers.count == 1:
    return busy
  gathered = [json.loads(v) for v in peers.all_gather(
      key, json.dumps({"step": step, "busy": busy}))]
  if len({g["step"] for g in gathered}) > 1:
    raise errors.InvalidArgumentError(
        f"the {peers.count} processes disagree on the step of {what}: "
        + "; ".join(f"process {p}: step {g['step']}" for p, g in enumerate(gathered))
        + ". Every process must call save with the same step, in the same order")
  return any(g["busy"] for g in gathered)


def settle_replicated(future: concurrent.futures.Future, step: int, mine: BaseException | None,
                      *, peers: Peers, key: str) -> None:
  """Resolves ``future`` (a handle's ``replicated``) with this process's outcome, and
  under N processes once every process's is (or failed): the first failure fails it."""
  if future.done():
    return
  if peers.count > 1:
    peers.publish(f"{key}/replicated", _describe(mine))
    for p in range(peers.count):
      if mine is not None:
        break
      try:
        theirs = peers.read(f"{key}/replicated", p, timeout=sync_timeout())
      except errors.SidecarError as e:
        theirs = _describe(e)
      if theirs:
        mine = errors.HostLostError(f"process {p} could not replicate step {step}: {theirs}")
  _resolve(future, mine, step)


def end_save(handle: SaveHandle, error: BaseException | None, *,
             listed: Callable[[], None] | None, collect_garbage: Callable[[], None] | None,
             replication: Callable[[], BaseException | None], peers: Peers, key: str) -> None:
  """The end of one save in one process, whichever framework's: ``durable`` fails with
  ``error``, or the step is listed (``listed``), ``durable`` resolves and the steps no
  longer kept are deleted (no part of this save's time); then ``replicated`` settles,
  once every process knows how its replication went (``replication()``: this process's
  outcome, waited for). Blocks: a save's own thread calls it."""
  if error is not None:
    _resolve(handle.durable, error, None)
  else:
    if listed is not None:
      listed()
    _resolve(handle.durable, None, handle.step)
    if collect_garbage is not None:
      collect_garbage()
  if not handle.replicated.done():
    settle_replicated(handle.replicated, handle.step,
                      error if error is not None else replication(), peers=peers, key=key)


def _replica_target(host: int, record: Mapping[str, Any]) -> ReplicaTarget:
  """A sidecar's record (``Sidecars.records``: address, worker socket, boot id) as the
  replica target its replicas are sent to."""
  return ReplicaTarget(host, str(record["address"]), str(record.get("socket") or ""),
                       str(record.get("boot_id") or ""))


class SaveCoordinator:
  """Runs saves: stages this process's shards, then commits with the others or aborts.

  Args:
    client: the sidecars.
    directory: the checkpoint directory (absolute).
    hosts: every sidecar host; ``local``: those this process stages into.
    device_hosts: the host of each device id.
    peers: the trainer processes; process 0 begins, commits and aborts.
    key: the prefix of this checkpointer's agreement keys.
    replicas: peer copies per shard; ``placement``: each host's peers;
      ``sidecars``: their addresses; ``replica_bandwidth``: bytes/s, or None.
    list_step: lists a committed step; ``collect_garbage``: drops the steps no longer kept.
    framework: describes a state tree's shards (which this process saves).
    writers: the processes that stage into each host, where several share one (each
      sends its own parts; the host's step is whole once all of them have).
  """

  def __init__(self, *, client: CheckpointTransport, directory: str, hosts: list[int],
               local: list[int], device_hosts: dict[int, int], peers: Peers,
               key: str, replicas: int, placement: dict[int, list[int]],
               sidecars: dict[int, dict[str, Any]], replica_bandwidth: int | None,
               list_step: Callable[[int], None], collect_garbage: Callable[[], None],
               framework: Framework, writers: Mapping[int, Sequence[int]] | None = None):
    self._framework = framework
    self._client, self.directory, self._hosts, self._local = client, directory, hosts, local
    self._device_hosts, self._peers, self._key = device_hosts, peers, key
    self._lead = peers.index == 0
    self._replicas, self._placement, self._sidecars = replicas, placement, sidecars
    self._replica_bandwidth = replica_bandwidth
    self._list_step, self._collect_garbage = list_step, collect_garbage
    self._protocol = SaveProtocol(
        client=client, directory=directory, writers=writers)
    self._saves = 0
    self.finisher: threading.Thread | None = None  # the latest save's, until it ends
    # Every save's that may still run: an older one settles its replication (replicas > 0)
    # and deletes old steps after its durable, while the next save runs.
    self.finishers: list[threading.Thread] = []

  def agree_on_save(self, step: int, busy: bool) -> bool:
    """Checks every process saves ``step``; returns whether any has a save in flight."""
    return agree_on_save(self._peers, f"{self._key}/save/{self._saves + 1}/step", step, busy,
                         what=f"save {self._saves + 1} in {self.directory}")

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
    staging = Parts(self._local, parts)
    try:
      specs, plan = self._plan(tree)
      need = self._check_fits(plan)
    except BaseException as e:
      if self._peers.count > 1:  # the other processes wait for this one's part: tell them
        parts.put(e)
        self._start_finisher(handle, target, staging, [], data_json, key).join()
      raise
    finisher = self._start_finisher(handle, target, staging, specs, data_json, key)
    blocks: list = []
    late: list = []  # shards on their way from a device: the stager copies them
    try:
      blocks = self._blocks(plan, need)
      for (host, leaf, shard), (copy, ref) in zip(plan, blocks):
        if isinstance(shard.data, HostCopy):
          late.append((host, leaf, shard.index, shard.data, copy, ref))
          continue
        interrupts.check()  # Ctrl-C aborts the save (below)
        shm.copy(copy, shard.data)  # the one copy the trainer waits for
        staging.add(host, StagedShard(leaf, shard.index, copy, ref), shard.data.nbytes)
    except BaseException as e:
      staging.clear()  # The traceback keeps this frame: let the blocks go.
      blocks.clear()
      late.clear()
      parts.put(e)  # the save is aborted
      finisher.join()  # and its files are gone before the caller can retry the step
      raise
    blocks.clear()
    if not late:
      staging.close()
      return handle
    staging.stager = threading.Thread(target=stage_late, args=(late, staging), daemon=True,
                                      name=f"sidecar-stage-{step}")
    staging.stager.start()  # the finisher joins it
    return handle

  def _blocks(self, plan: list[tuple[int, int, SaveShard]], need: Mapping[int, int]
              ) -> list[tuple[np.ndarray, codec.ArenaRef | None]]:
    """An arena block for each shard of ``plan``, in its order: one request per host."""
    out: list = [None] * len(plan)
    for host in self._local:
      mine = [i for i, p in enumerate(plan) if p[0] == host]
      if not mine:
        continue
      try:
        got = self._client.empty_like(host, [plan[i][2].data for i in mine])
      except errors.ResourceExhaustedError as e:
        if isinstance(e, errors.BusyError):
          raise
        raise errors.ResourceExhaustedError(
            f"the state does not fit host {host}'s arena now ({shm.format_size(need[host])} "
            f"to copy there): {e}; nothing was kept") from None
      for i, block in zip(mine, got):
        out[i] = block
    return out

  def _plan(self, tree: Any) -> tuple[list[spec_lib.LeafSpec], list[tuple[int, int, SaveShard]]]:
    """Leaf specs, and ``(host, leaf number, shard)`` for every shard to copy, each once.

    The framework says which shards this process saves (of replicated ones only
    replica 0, by the process that holds it); those on no device, process 0 copies
    into its first host.
    """
    specs, plan = [], []
    for i, leaf in enumerate(self._framework.save_leaves(tree)):
      specs.append(leaf.spec)
      for shard in leaf.shards:
        if shard.device_id is None:
          if self._lead:
            plan.append((self._local[0], i, shard))
          continue
        host = self._device_hosts.get(shard.device_id)
        if host is None:
          raise errors.InvalidArgumentError(
              f"leaf {leaf.spec.param_name!r} has a shard on device {shard.device_id}, which "
              "no sidecar host declares (sidecar serve --device-ids)")
        plan.append((host, i, shard))
    return specs, plan

  def _check_fits(self, plan) -> dict[int, int]:
    """The arena bytes the plan takes on each host; raises where it exceeds a whole arena
    (no rpc while the trainer waits: an arena too full now fails the copy's allocation)."""
    need: dict[int, int] = {}
    for host, _, shard in plan:
      need[host] = need.get(host, 0) + -(-max(shard.data.nbytes, 1) // shm.PAGE) * shm.PAGE
    short = {h: (n, size) for h, n in need.items()
             if (size := self._client.arena_size(h)) is not None and n > size}
    if short:
      detail = "; ".join(f"host {h} needs {shm.format_size(n)}, its arena is "
                         f"{shm.format_size(size)}" for h, (n, size) in short.items())
      raise errors.ResourceExhaustedError(
          f"the state does not fit the arenas ({detail}); nothing was copied. Raise the "
          "sidecars' --shm-size (it must hold a save plus the RAM tier and prefetched batches)")
    return need

  def _start_finisher(self, handle: SaveHandle, target: Target, staging: Parts,
                      leaves: list, data_json: str, key: str) -> threading.Thread:
    finisher = threading.Thread(target=self._finish,
                                args=(handle, target, staging, leaves, data_json, key),
                                daemon=True, name=f"sidecar-save-{handle.step}")
    finisher.start()
    self.finisher = finisher
    self.finishers = [t for t in self.finishers if t.is_alive()] + [finisher]
    return finisher

  def _finish(self, handle: SaveHandle, target: Target, staging: Parts, leaves,
              data_json: str, key: str) -> None:
    """Stages this process's parts, then commits with the others (or aborts)."""
    try:
      self._finish_staged(handle, target, staging.parts, leaves, data_json, key)
    finally:
      if staging.stager is not None:
        staging.stager.join()  # done, or copying what nobody will stage

  def _finish_staged(self, handle: SaveHandle, target: Target, parts: queue.SimpleQueue,
                     leaves, data_json: str, key: str) -> None:
    step, error, sums, replication = handle.step, None, [], None
    try:
      self._begin(target, key)
      self._protocol.stage(target, parts, hosts=self._local, leaves=leaves)
      handle.staged.set_result(step)
      replication = (self._protocol.start_replication(
          target, {h: self._placement[h] for h in self._local}, self._sidecars,
          bandwidth=self._replica_bandwidth) if self._replicas else None)
      if replication is not None and self._peers.count == 1:  # resolved as soon as done
        replication.add_done_callback(
            lambda f: _resolve(handle.replicated, f.exception(), handle.step))
      sums = self._protocol.prepared(target, self._local)
    except BaseException as e:  # every process must reach the commit's agreement
      error = e.with_traceback(None)  # its frames would hold the staged blocks
    try:
      self._commit(target, key, leaves, sums, data_json, error)
    except BaseException as e:  # the save failed: its futures say why
      if not handle.staged.done():
        handle.staged.set_exception(e)
      error = e
    else:
      error = None

    def replicated() -> BaseException | None:
      if replication is None:
        return errors.InvalidArgumentError(f"step {step} was not replicated")
      return replication.exception()  # waits for it
    whole = target.whole_step  # a part of a step (save_to) is listed by its caller
    end_save(handle, error, listed=(lambda: self.mark_committed(target)) if whole else None,
             collect_garbage=self._collect_garbage if whole else None,
             replication=replicated, peers=self._peers, key=key)

  def _begin(self, target: Target, key: str) -> None:
    """Process 0 creates the step's tmp directory; the others wait until it has."""
    if not self._lead:
      failed = self._peers.read(f"{key}/begun", 0, timeout=sync_timeout())
      if failed:
        raise errors.InvalidArgumentError(
            f"process 0 could not begin step {target.step}: {failed}")
      return
    try:
      if target.whole_step:
        self._protocol.begin(self._local[0], self.directory, target.step)
    except BaseException as e:
      self._peers.publish(f"{key}/begun", _describe(e))
      raise
    self._peers.publish(f"{key}/begun", "")

  def _commit(self, target: Target, key: str, leaves: list[spec_lib.LeafSpec],
              sums: list[ShardChecksum], data_json: str,
              error: BaseException | None) -> None:
    """Process 0 gathers every process's prepared, then commits once or aborts.

    Every process gets here once per save, failed or not, so nobody waits for one
    that gave up. The save fails in every process if it failed in any.
    """
    mine = json.dumps({"error": protocol.error_dict(error)} if error is not None
                      else {"ok": [c.to_dict() for c in sums]})
    if not self._lead:
      self._peers.publish(f"{key}/prepared", mine)
      failed = self._peers.read(f"{key}/outcome", 0, timeout=_LONG_S)
      if error is not None:
        raise error
      if failed:
        raise _gathered(json.loads(failed), 0, f"the save of step {target.step} failed")
      return
    try:
      gathered = [json.loads(v) for v in self._peers.all_gather(
          f"{key}/prepared", mine, timeout=_LONG_S)]
      failures = [(p, g["error"]) for p, g in enumerate(gathered) if "error" in g]
      if error is not None:
        raise error
      if failures:  # the first as it was raised (its kind, its host); the others noted
        p, first = failures[0]
        raise _gathered(first, p, f"the save of step {target.step} failed in process {p}"
                        + "".join(f"; also in process {q}: {d.get('type')}: "
                                  f"{str(d.get('message'))[:500]}" for q, d in failures[1:]))
      # A host that several processes share reports its checksums to each: keep one.
      checksums = list(dict.fromkeys(ShardChecksum.from_dict(c)
                                     for g in gathered for c in g["ok"]))
      self._protocol.commit(self._local[0], target, num_hosts=len(self._hosts),
                            checksums=checksums, leaves=leaves, data_state_json=data_json,
                            replicas=self._placement)
    except BaseException as e:
      self._protocol.abort(target, self._hosts)  # before anyone fails: a retry must not race
      self._peers.publish(f"{key}/outcome", json.dumps(protocol.error_dict(e)))
      raise
    self._peers.publish(f"{key}/outcome", "")

  def mark_committed(self, target: Target) -> None:
    """Tells the RAM tiers the step is visible; lists it."""
    self._protocol.mark_committed(target, self._local)
    if target.whole_step:
      self._list_step(target.step)


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


def _gathered(d: dict, process: int, note: str) -> errors.SidecarError:
  """The error another process gathered at the commit (``protocol.error_dict``): its
  kind and host as raised there, with ``note`` saying where the save failed."""
  error = protocol.error_from_dict(d, host=f"trainer process {process}")
  error.add_note(note)
  return error
