"""One save step, whichever framework drives it: :class:`SaveRun`.

A save step is one object from begin to its end, and both frameworks call the same
methods on it: the key-value path (``plugs.SaveRunner``: JAX's and the numpy core's)
from its finisher thread, DCP's ``torch/storage.StorageWriter`` from its hooks
(``prepare_global_plan`` begins, ``write_data`` stages, ``finish`` finishes, and
``torch/checkpointer.DcpDriver`` ends it once DCP's upload ended):

- :meth:`SaveRun.begin`: the step's tmp directory (the lead process's sidecar answers it);
- :meth:`SaveRun.stage` (lots a finisher is handed) or :meth:`SaveRun.stage_copies`
  (copies made and sent on the caller's thread, no thread of its own);
- :meth:`SaveRun.finish`, the one place that decides what follows staging: the
  replication starts, the processes agree, and the lead waits for the commit the sidecars
  agree on (a step they took over at its last Stage: :attr:`SaveRun.plan`), or asks each
  host for its written records (prepared) and commits once, or every host aborts; the RAM
  tiers are told the step is committed;
- :meth:`SaveRun.end`: the Checkpointer's end of the step (:func:`end_save`: listed,
  ``durable``, old steps deleted, ``replicated`` once every process knows), on the
  calling thread;
- :attr:`SaveRun.stats`: its stage and replication times and bytes.

The :class:`SaveHandle` a save returns is the step's: the run resolves its ``staged``,
``durable`` and ``replicated``; a Checkpointer's save ends as its :class:`Ending` says.

How the trainer processes coordinate the sequence (who begins, who commits) is a
``coordination.Coordination``: through their key-value store, or as DCP does it. The
sequence's calls on the sidecars, and the step's ``save_protocol.Target``, are
``save_protocol``'s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import queue
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sidecar._src.ckptfmt import spec as spec_lib
from sidecar._src.ckptfmt.records import CommitPlan
from sidecar._src.ckptfmt.save_values import AwaitCommit, Begin, Commit, Stage
from sidecar._src.controller.checkpoint.client import FormatExtra
from sidecar._src.controller.checkpoint.coordination import Begun, Coordination, describe
from sidecar._src.controller.checkpoint.retention import Retention
from sidecar._src.controller.checkpoint.save_protocol import (
  SaveProtocol,
  Sends,
  Staging,
  Target,
)
from sidecar._src.controller.checkpoint.staging import Lots, ShardCopy, allocate, copy_in
from sidecar._src.controller.peers import Peers, sync_timeout
from sidecar._src.core import errors

log = logging.getLogger(__name__)


class Durable(concurrent.futures.Future):
  """A save's ``durable``: a Future that remembers whether its error was told to a caller
  (``result()`` raised it, ``exception()`` returned it), so the Checkpointer does not raise
  it a second time at the next save, wait or close."""

  told = False

  def result(self, timeout: float | None = None) -> Any:
    try:
      return super().result(timeout)
    except concurrent.futures.TimeoutError:
      if not self.done():
        raise
      self.told = True  # the save's own error is a TimeoutError (DeadlineExceededError)
      raise
    except BaseException:
      self.told = True
      raise

  def exception(self, timeout: float | None = None) -> BaseException | None:
    error = super().exception(timeout)
    self.told = self.told or error is not None
    return error

  def error(self) -> BaseException | None:
    """The error of a done save (None: it succeeded), no caller told of it by this."""
    return concurrent.futures.Future.exception(self, 0)

  def untold(self) -> BaseException | None:
    """The error of a done save that no caller was told of yet (None: none)."""
    return None if self.told else self.error()


@dataclasses.dataclass(frozen=True, slots=True)
class SaveHandle:
  """``staged``: the state is in the arenas (the trainer may change its arrays);
  ``durable``: the step is committed on storage; ``replicated``: every shard has its
  replica copies (``replicas=R``; at once with R=0, JAX's and PyTorch's alike). All are
  ``concurrent.futures.Future``s that hold the step (None for a skipped save).
  ``taken_over``: a Future of whether this process's hosts took the step over as it
  was staged (True: their sidecars commit it whatever happens to the trainers, and an
  in-process rollback may restore it from their RAM tiers before it is durable; False:
  its trainers commit it, or it was skipped or failed)."""
  step: int
  staged: concurrent.futures.Future
  durable: Durable
  replicated: concurrent.futures.Future = dataclasses.field(
      default_factory=concurrent.futures.Future)
  taken_over: concurrent.futures.Future = dataclasses.field(
      default_factory=concurrent.futures.Future)


def done_handle(step: int, value: Any) -> SaveHandle:
  """A handle whose futures all hold ``value`` already (a save skipped: ``if_busy``)."""
  staged, durable = concurrent.futures.Future(), Durable()
  staged.set_result(value)
  durable.set_result(value)
  replicated: concurrent.futures.Future = concurrent.futures.Future()
  replicated.set_result(value)
  taken_over: concurrent.futures.Future = concurrent.futures.Future()
  taken_over.set_result(False)
  return SaveHandle(step, staged, durable, replicated, taken_over)


@dataclasses.dataclass(frozen=True, slots=True)
class Ending:
  """How a Checkpointer's save ends (:func:`end_save`): its ``handle``, the
  processes that settle ``replicated`` together under ``key``, and the steps a commit
  lists (``retention``; None: no step of its own, as an Orbax manager's item)."""
  handle: SaveHandle
  peers: Peers
  key: str
  retention: Retention | None


class SaveRun:
  """One save step on the sidecars, from begin to its end (see the module).

  Args:
    protocol: the sequence's calls, in the step's format.
    target: where the step goes (begun by :meth:`begin`, or given begun: :meth:`begun`).
    hosts: every host the step is on (a commit counts them; an abort reaches them).
    local: the hosts this process stages into and waits for (prepared), replicates and
      tells of the commit.
    placement: each host's replica hosts (by host id); ``bandwidth``: bytes/s, or None.
    coordination: how the trainer processes agree (:class:`KeyValue`, :class:`Coordinator`).
    ending: a Checkpointer's save's end (None: a ``StorageWriter`` of its own).
    share_manifest: whether the committing sidecar alone built the manifest, which the
      other RAM tiers are then told (DCP's, whose commit carries DCP's metadata).
    path: what Begin is given, default the target's directory (a DCP checkpoint: its
      own path, its tmp directory beside it).
  """

  def __init__(self, protocol: SaveProtocol, target: Target, *, hosts: Sequence[int],
               local: Sequence[int], placement: Mapping[int, Sequence[int]],
               bandwidth: int | None, coordination: Coordination,
               ending: Ending | None = None, share_manifest: bool = False, path: str = ""):
    self.protocol, self.target = protocol, target
    self.hosts, self.local = list(hosts), list(local)
    self._placement = {h: list(p) for h, p in placement.items() if p}
    self._bandwidth, self._coordination = bandwidth, coordination
    self.ending, self._share_manifest, self._path = ending, share_manifest, path
    self.replication: concurrent.futures.Future | None = None
    self.stats: dict[str, float] = {}
    self._begun = Begun("")
    self._first_stage_begins: Begin | None = None  # the Begin its first Stage carries
    # What the sidecars commit the step with, themselves (its last Stages carry it); None:
    # the trainers commit it.
    self.plan: CommitPlan | None = None
    # Where the step was committed all the same after its save failed (its abort found it
    # so, :meth:`finish`); None: it was not.
    self.committed_at: str | None = None

  @property
  def step(self) -> int:
    return self.target.step

  def begin(self) -> Target:
    """The lead process's sidecar makes the step's tmp directory (the others are told
    it, and the save's id); the target is then in the tmp directory Begin answered
    (never one worked out here). An Orbax manager's item (not ``whole_step``) is in the
    manager's already."""
    t = self.target

    def here() -> Begun:
      if not t.whole_step:
        return Begun("")
      host = self.local[0]
      begin = Begin(self._path or t.directory, t.step, self.protocol.format)
      if self._begins_with_stage():  # one round trip less: where its Begin would make it
        self._first_stage_begins = begin
        return Begun(t.fmt.tmp_of(begin.directory, begin.step), host, uuid.uuid4().hex,
                     with_stage=True)
      return Begun(self.protocol.begin(host, begin), host, uuid.uuid4().hex)
    self._begun = self._coordination.begin(t.step, here)
    return self.begun(self._begun.tmp)

  def _begins_with_stage(self) -> bool:
    """Whether the step's first Stage begins it (no Begin of its own): a step the sidecars
    take over (:meth:`_plan`'s) that this process stages on one host, the one it begins
    it on. Its Stages are then one round trip, which ``save()`` waits for."""
    t = self.target
    return (len(self.local) == 1 and self._coordination.takes_over and not self._path
            and t.fmt.commit_extra is None and not self._share_manifest)

  def _told_begun(self, error: BaseException | None) -> None:
    """The first Stage that was to begin the step answered (``error`` None: it is begun)
    or failed (never begun there: an abort removes nothing); the other processes are
    told, once."""
    b = self._begun
    if not b.with_stage:
      return
    self._begun = dataclasses.replace(b, with_stage=False)
    if error is not None:
      self.target = dataclasses.replace(self.target, tmp_dir="", tmp_step="")
    self._coordination.announce(b, error)

  def begun(self, tmp: str) -> Target:
    """The step once a sidecar began it in ``tmp`` (Begin's answer, which DCP's plan
    carries to the other ranks); "" leaves it as it is."""
    if tmp:
      self.target = self.target.begun(tmp)
    return self.target

  def stage(self, lots: queue.SimpleQueue, *, leaves: Sequence[spec_lib.LeafSpec] = (),
            data_state_json: str = "") -> None:
    """Hands the staged lots ``lots`` is given (``staging.Lots``) to the sidecars of
    :attr:`local` as they come, until each had its last; then ``staged`` resolves.

    Where the sidecars commit the step themselves (:attr:`plan`: a whole step in a format
    whose commit needs nothing from the trainers, as the key-value processes save it),
    each host's last lot carries the plan (with ``data_state_json``), and each host takes
    the step over before it answers: once ``staged`` resolves in every process, the step
    is the sidecars' to commit, whatever happens to the trainers."""
    self.plan = self._plan(data_state_json)
    begin = self._first_stage_begins if self._begun.with_stage else None
    try:
      # staged resolves as the last Stage's answer comes (on its thread: save(), waiting
      # for it, need not wait for this one to wake too).
      t = self.target
      Sends(self.protocol, Staging(hosts=self.local, first=Stage(
          self.protocol.directory, t.step, t.tmp_dir, t.final_dir, leaves=leaves, plan=self.plan,
          begin=begin), told=self._told_begun, whole=self._staged)).drain(lots)
    except BaseException as e:
      self._told_begun(e)  # where its first Stage never went: the others are not left waiting
      raise
    self._staged()

  def _staged(self) -> None:
    """Every host of :attr:`local` answered its last Stage (took the step over, with a
    plan): ``staged`` resolves."""
    if self.ending is not None:
      resolve(self.ending.handle.taken_over, None, self.plan is not None)
      resolve(self.ending.handle.staged, None, self.step)
      # The GIL let go once: save(), waiting for staged, returns now rather than after this
      # thread's next Python work (the finisher's commit call; a Stage answer's end)
      # (staged to returned: 0.5-1.3 ms, 0.2-0.4 with it, measured; issue 69: save() of 4
      # MiB 6.1-7.2 ms median, 6.3-7.7 without it here, in alternating runs).
      time.sleep(0)

  def _plan(self, data_state_json: str) -> CommitPlan | None:
    """The plan the sidecars commit the step with, or None (its trainers commit it)."""
    b, t = self._begun, self.target
    if (not self._coordination.takes_over or b.committer is None or not t.whole_step
        or t.fmt.commit_extra is not None or self._share_manifest):
      return None
    writers = self.protocol.writers  # (known where several processes save)
    hosts = (tuple(self.local) if self._coordination.alone else
             tuple(h for h in sorted(writers) if h in self.hosts) if writers else
             tuple(self.hosts))
    lead = self._coordination.lead
    return CommitPlan(save=b.save, committer=b.committer, hosts=hosts,
                      data_state_json=data_state_json if lead else "", lead=lead,
                      replicas={h: tuple(p) for h, p in self._placement.items()})

  def stage_copies(self, host: int, copies: list[ShardCopy], *,
                   extra: FormatExtra | None = None, threads: int | None = None) -> None:
    """Stages this process's shards ``copies`` on ``host``, on the calling thread: those
    in no arena yet copied into blocks of the host's (allocated in one request) by the
    one stager (``staging.copy_in``), each lot sent to the sidecar as soon as it is
    copied, each with the format's ``extra``. On a failure (Ctrl-C too, between two
    copies) the host's part is dropped again, and it raises. ``copies`` is emptied: its
    blocks are the sidecar's once staged."""
    t0 = time.perf_counter()
    t = self.target
    sends = Sends(self.protocol, Staging(hosts=[host], first=Stage(
        self.protocol.directory, t.step, t.tmp_dir, t.final_dir, extra=extra)))
    lots = Lots([host], sends.put)
    try:
      try:
        allocate(self.protocol.client.empty_like, copies, host)
      except BaseException as e:
        lots.fail(e.with_traceback(None))
        raise
      late = copy_in(copies, lots, threads=threads)
      if late is not None:
        late.wait()
      sends.wait()
    except BaseException:
      copies.clear()
      sends.settle()  # the abort reaches the sidecar after its last stage call
      self.protocol.abort(self.target, [host])
      raise
    self.stats["stage_s"] = time.perf_counter() - t0

  def finish(self, error: BaseException | None = None, *,
             leaves: Sequence[spec_lib.LeafSpec] = (), data_state_json: str = "",
             extra: FormatExtra | None = None) -> None:
    """What follows staging, for every framework: with ``error`` None (this process's
    part is staged), the replication starts and :attr:`local` finish their writes
    (prepared); the processes agree; the step is committed once (with ``leaves``,
    ``data_state_json`` and the format's ``extra``) and the RAM tiers told, or aborted on
    every host. Raises the save's error (in every process where it failed in any).

    A step the sidecars took over (:attr:`plan`) is committed by them once written on
    every host, the trainers there or not: the lead process only waits for that commit
    (or aborts the step where a process failed to stage its part)."""
    plan, written = self.plan, []
    if error is None:
      try:
        self._replicate()
        if plan is None:
          written = self.protocol.prepared(self.target, self.local)
      except BaseException as e:  # every process must reach the commit's agreement
        error = e.with_traceback(None)  # its frames would hold the staged blocks
    t = self.target
    commit: Callable[[Sequence[int]], object]
    if plan is None:  # once every host wrote (``others``: those other processes staged into)
      mine = Commit(tmp_dir=t.tmp_dir, step=t.step, num_hosts=len(self.hosts), shards=written,
                    leaves=leaves, data_state_json=data_state_json, whole_step=t.whole_step,
                    replicas=self._placement or None, extra=extra)
      commit = lambda others: self.protocol.commit(self.local[0], dataclasses.replace(
          mine, shards=[*mine.shards, *self.protocol.prepared(t, others)]))
    else:  # the sidecars commit the step they took over (``others`` is theirs to gather)
      wait, on = AwaitCommit(t.tmp_dir, t.step), plan.committer
      commit = lambda others: self.protocol.commit(on, wait)
    aborted: list[str | None] = []  # where the abort found the step committed, if it ran
    # Asked first (``SaveProtocol.abort``): the sidecars' committer, or the one we commit through.
    committer = plan.committer if plan is not None else self.local[0] if self.local else None
    # The RAM tiers a commit tells: an Orbax manager's item is marked when the manager
    # commits; the committer of a step the sidecars took over marked it itself.
    told = [h for h in self.local if plan is None or h != plan.committer] if (
        self.target.whole_step) else []
    try:
      self._coordination.commit(self.step, error, commit, lambda: aborted.append(
          self.protocol.abort(self.target, self.hosts, committer=committer)))
    except BaseException as e:
      if aborted and aborted[0] != "":
        e.add_note(
            f"step {self.step} was committed all the same, at {aborted[0]}: host "
            f"{committer}'s commit of it had begun before the abort reached it; restores "
            "see it" if aborted[0] else
            f"whether step {self.step} is committed is not known: host {committer}, which "
            "commits it, did not answer the abort; nothing of it was removed (restores see "
            "it if its commit ended; if not, the directory's next open() sweeps its files)")
      if self.ending is not None:
        resolve(self.ending.handle.taken_over, None, False)
        resolve(self.ending.handle.staged, e, None)
      if aborted and aborted[0]:  # the error stands; the step is told as any commit's
        self.committed_at = aborted[0]
        self._mark_committed_all_the_same(told)
      raise
    self.mark_committed(told)

  def _mark_committed_all_the_same(self, told: Sequence[int]) -> None:
    """The RAM tiers a commit tells (:meth:`finish`) learn of a step committed all the
    same; where they cannot, the save's own error is the trainer's still (logged)."""
    try:
      self.mark_committed(told)
    except errors.SidecarError as e:
      log.warning("step %d was committed all the same, but the RAM tiers of hosts %s could "
                  "not be told: %s; restores read it from storage", self.step, list(told),
                  str(e))

  def mark_committed(self, hosts: Sequence[int]) -> None:
    """Tells ``hosts``' RAM tiers the step is visible (with the manifest where the
    committing sidecar alone built it)."""
    if not hosts:
      return
    manifest = (self.protocol.client.info(self.local[0], self.target.final_dir).result()
                .to_json() if self._share_manifest else "")
    self.protocol.mark_committed(self.target, hosts, manifest)

  def _replicate(self) -> None:
    """Each of :attr:`local` sends its staged part to its replica hosts, from now on
    (once every host's part is staged, before the commit); :attr:`replication` is its
    future, None with no replicas."""
    self.replication = self.protocol.start_replication(
        self.target, {h: self._placement[h] for h in self.local if h in self._placement},
        bandwidth=self._bandwidth)
    if self.replication is None:
      return
    t0 = time.perf_counter()

    def done(f: concurrent.futures.Future) -> None:
      if f.exception() is None:
        self.stats.update(replicate_s=time.perf_counter() - t0,
                          replicated_bytes=float(sum(r.nbytes for r in f.result())))
      e = self.ending
      if e is not None and e.peers.count == 1:  # resolved as soon as done
        resolve(e.handle.replicated, f.exception(), self.step)
    self.replication.add_done_callback(done)

  def replication_error(self) -> BaseException | None:
    """Waits for this process's replication; its error (None: replicated, or none)."""
    return self.replication.exception() if self.replication is not None else None

  def end(self, error: BaseException | None) -> None:
    """The step's end in this process, on the calling thread: ``durable`` fails with
    ``error``, or the step is listed, ``durable`` resolves and old steps go; then
    ``replicated`` settles with every process. Nothing without an :attr:`ending`."""
    e = self.ending
    if e is None:
      return
    r = e.retention if self.target.whole_step else None
    end_save(e.handle, error, committed=self.committed_at is not None,
             listed=functools.partial(r.add, self.step) if r is not None else None,
             collect_garbage=r.collect if r is not None else None,
             replication=self.replication_error, peers=e.peers, key=e.key)


def settle_replicated(future: concurrent.futures.Future, step: int, mine: BaseException | None,
                      *, peers: Peers, key: str) -> None:
  """Resolves ``future`` (a handle's ``replicated``) with this process's outcome, and
  under N processes once every process's is (or failed): the first failure fails it."""
  if future.done():
    return
  if peers.count > 1:
    peers.publish(f"{key}/replicated", describe(mine))
    for p in range(peers.count):
      if mine is not None:
        break
      try:
        theirs = peers.read(f"{key}/replicated", p, timeout=sync_timeout())
      except errors.SidecarError as e:
        theirs = describe(e)
      if theirs:
        mine = errors.HostLostError(f"process {p} could not replicate step {step}: {theirs}")
  resolve(future, mine, step)


def end_save(handle: SaveHandle, error: BaseException | None, *,
             listed: Callable[[], None] | None, collect_garbage: Callable[[], None] | None,
             replication: Callable[[], BaseException | None], peers: Peers, key: str,
             committed: bool = False) -> None:
  """The end of one save in one process, whichever framework's: ``durable`` fails with
  ``error``, or the step is listed (``listed``), ``durable`` resolves and the steps no
  longer kept are deleted (no part of this save's time); then ``replicated`` settles,
  once every process knows how its replication went (``replication()``: this process's
  outcome, waited for). ``committed``: the step was committed all the same (its abort
  found it so): listed and its old steps deleted as any commit's, ``durable`` failing
  with ``error``. Blocks: a save's own thread calls it."""
  resolve(handle.taken_over, None, False)  # unless its stage said so (SaveRun.stage)
  listing = error is None or committed
  if listing and listed is not None:
    listed()
  resolve(handle.durable, error, handle.step)
  if listing and collect_garbage is not None:
    collect_garbage()
  if not handle.replicated.done():
    settle_replicated(handle.replicated, handle.step,
                      error if error is not None else replication(), peers=peers, key=key)


def resolve(future: concurrent.futures.Future, error: BaseException | None, value: Any
             ) -> None:
  """Sets ``future`` unless it is set already (a callback and a thread may race)."""
  try:
    if error is not None:
      future.set_exception(error)
    else:
      future.set_result(value)
  except concurrent.futures.InvalidStateError:
    pass
