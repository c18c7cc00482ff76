"""The RAM tier of one sidecar: the steps it staged, the replicas it holds, its budgets.

It holds each ``step.Step`` (this host's own shards of a step, and how far the step got:
its states are that module's) and each :class:`Replica` (the shards of a step another
sidecar sent here). :class:`RamTier` keeps them under its own lock, behind queries (a
step by item or tmp directory, the commits pending in a directory, the steps in flight,
what it holds) and commands (receive, replace or discard a replica, configure a
directory's RAM steps), and is the one place a step enters (``slot``, ``add``) and leaves
(``remove``, ``drop``, ``expire_uncommitted``) it: no caller takes its lock, no caller's
code runs under it (it answers with lists and values its callers read outside it), and it
takes it outside a step's. It reads a step's ``view()`` (``lifecycle.VIEWS``), never how the step
keeps its state.
``committed`` keeps the newest steps of a directory within its ``ram_steps`` and
``ram_budget`` (own shards and replicas counted together), and the newest committed steps of
a group of directories (a pool tenant's) within the group's budget; steps written but never
committed expire, and ``status``/``usage`` report what is held.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.records import Held, Manifest, ShardId
from sidecar._src.core import errors
from sidecar._src.server.checkpoint.copies import Replica
from sidecar._src.server.checkpoint.step import Step, Takeover
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Holdings:
  """What a RAM tier holds at one moment (read under its lock): its steps, its replicas,
  the items committed in the order of their commits, and each directory's group."""
  steps: tuple[Step, ...]
  replicas: tuple[Replica, ...]
  commits: tuple[str, ...]  # the committed items, oldest commit first
  group_of: Callable[[str], str | None]  # a directory's group (a pool tenant), if any


class Slot:
  """A Stage's look at the step the RAM tier holds for one item (``RamTier.slot``): one
  Stage at a time checks it, puts a new one in its place (``hold``) and takes its part.
  An abort, eviction or expiry may come between (the tier's lock is not held): it drops
  the step, whose ``take`` then raises ``step.StateError``, which the Stage answers."""

  def __init__(self, tier: RamTier, final_dir: str):
    self._tier, self._final_dir = tier, final_dir
    self.step: Step | None = tier.find(final_dir)

  def hold(self, own: Step) -> None:
    """``own`` in the tier for its item: a step held there before is dropped."""
    assert own.final_dir == self._final_dir
    self._tier.add(own)
    self.step = own


class RamTier:
  """The steps and replicas one sidecar (``host_id``) holds.

  Its lock, its own, guards which ones it holds, the replicas' fields and the budgets; a
  step's state and shards are the step's own (``step.Step``, whose lock is taken inside
  this one, by the tier alone): a step enters by :meth:`slot` or :meth:`add` and leaves by
  :meth:`remove`, :meth:`remove_item`, :meth:`drop` or :meth:`expire_uncommitted`, each
  dropping it (``Step.drop``). A replica enters by :meth:`open_replica` and
  leaves with its step, or by :meth:`discard_partial`.
  """

  def __init__(self, host_id: int, *, uncommitted_s: float,
               group_budget: Callable[[str], int | None] = lambda group: None):
    self.host_id = host_id
    self.uncommitted_s = uncommitted_s
    self._lock = threading.Lock()
    # One Stage at a time looks at, holds and takes a step (``slot``); taken before the
    # tier's lock, never under it.
    self._stage_lock = threading.Lock()
    self._steps: dict[str, Step] = {}  # by committed item directory
    self._replicas: dict[tuple[str, int], Replica] = {}  # by (final_dir, source host)
    # Items committed() was told of, in the order of their commits: True while in the RAM
    # tier, False once evicted (a replica that arrives after its step's commit learns its
    # fate here).
    self._committed_dirs: dict[str, bool] = {}
    self._ram_steps: dict[str, tuple[int, int | None]] = {}  # directory -> (steps, budget)
    # Directories (resolved) -> the group they count in (a pool tenant), whose committed
    # steps together keep within ``group_budget(group)`` bytes (None: no bound).
    self._groups: dict[str, str] = {}
    self._group_budget = group_budget
    self._resolved: dict[str, str] = {}  # directory as given -> resolved

  # ---- queries ------------------------------------------------------------

  def step_at(self, final_dir: str) -> Step:
    """The step staged here for ``final_dir``; InvalidArgumentError if there is none."""
    own = self.find(final_dir)
    if own is None:
      raise errors.InvalidArgumentError(f"host {self.host_id} has not staged {final_dir}")
    return own

  def find(self, final_dir: str) -> Step | None:
    """The step held for the item ``final_dir``, if any."""
    with self._lock:
      return self._steps.get(final_dir)

  def find_tmp(self, tmp_dir: str) -> Step | None:
    """The step held whose uncommitted directory is ``tmp_dir``, if any."""
    with self._lock:
      return next((s for s in self._steps.values() if s.tmp_dir == tmp_dir), None)

  def steps(self) -> list[Step]:
    """The steps held (a list of its own: its caller reads them outside the lock)."""
    with self._lock:
      return list(self._steps.values())

  def replicas(self) -> list[Replica]:
    """The replicas held (a list of its own)."""
    with self._lock:
      return list(self._replicas.values())

  def pending_commits(self, directory: str) -> list[Step]:
    """The steps of ``directory`` taken over here whose end is not known yet."""
    return [s for s in self.steps()
            if s.directory == directory and s.takeover is Takeover.PENDING]

  def in_flight(self, directory: str | None = None) -> list[Step]:
    """The steps (of ``directory``; None: any) being written, or taken over and not yet
    ended (``View.in_flight``)."""
    return [s for s in self.steps()
            if (directory is None or s.directory == directory) and s.view().in_flight]

  def writing(self) -> list[Step]:
    """The steps whose write goes on (Status's ``writing``)."""
    return [s for s in self.steps() if s.view().writing]

  def copies_of(self, final_dir: str) -> list[Step | Replica]:
    """The step and the replicas held of the item ``final_dir``."""
    with self._lock:
      return self._copies_of(final_dir)

  def _copies_of(self, final_dir: str) -> list[Step | Replica]:
    """:meth:`copies_of`; the lock is held."""
    own = self._steps.get(final_dir)
    return [*([own] if own is not None else []),
            *(r for r in self._replicas.values() if r.final_dir == final_dir)]

  def replica_with(self, final_dir: str, shard: ShardId) -> Replica | None:
    """A whole, committed replica of ``final_dir`` that holds ``shard``, if any."""
    with self._lock:
      return next((r for r in self._replicas.values() if r.final_dir == final_dir
                   and r.whole and r.committed and shard in r.shards), None)

  def holdings(self, *, timeout: float = -1) -> Holdings | None:
    """What it holds now (``Holdings``, taken under its lock and read outside it: a
    replica's fields as they are then); None where the lock is busy for ``timeout`` s
    (-1: waits)."""
    if not self._lock.acquire(timeout=timeout):
      return None
    try:
      groups = dict(self._groups)
      return Holdings(tuple(self._steps.values()), tuple(self._replicas.values()),
                      tuple(self._committed_dirs), lambda d: groups.get(os.path.realpath(d)))
    finally:
      self._lock.release()

  # ---- steps --------------------------------------------------------------

  @contextlib.contextmanager
  def slot(self, final_dir: str) -> Iterator[Slot]:
    """The step held for ``final_dir`` (``Slot.step``; None: none), for one Stage at a
    time: a Stage checks it, holds a new one in its place and takes its part
    (``save.StepWriter.stage``). The Stages' own lock is held for the block, never the
    tier's: the Stage's code (the format's numbering among it) runs under no lock of the
    tier's, and the tier answers meanwhile, the block's own questions included."""
    with self._stage_lock:
      yield Slot(self, final_dir)

  def add(self, own: Step) -> None:
    """``own`` in the tier, by its ``final_dir``: a step held there before (its write
    ended: a save of the same step again) is dropped."""
    with self._lock:
      old = self._steps.get(own.final_dir)
      self._steps[own.final_dir] = own
      if old is not None and old is not own:
        old.drop()

  def remove(self, own: Step, why: BaseException | None = None) -> bool:
    """Drops ``own`` (``Step.drop``, ``why`` to a writer still waiting for its shards) if
    it is still this tier's step of its ``final_dir``; whether it was."""
    with self._lock:
      ours = self._steps.get(own.final_dir) is own
      if ours:
        del self._steps[own.final_dir]
        own.drop(why)
    return ours

  def remove_item(self, final_dir: str, why: BaseException | None = None) -> Step | None:
    """Drops the step and the replicas of ``final_dir`` held here (a save aborted),
    ``why`` to a writer still waiting for its shards; returns the step, if one was here."""
    with self._lock:
      own = self._steps.pop(final_dir, None)
      for key in [k for k in self._replicas if k[0] == final_dir]:
        del self._replicas[key]
      if own is not None:
        own.drop(why)
    return own

  def mark_committed(self, final_dir: str) -> list[int]:
    """Marks a step (own shards and replicas) committed; evicts steps beyond the budget.
    Returns the kept steps. This host's own shards are marked once written here
    (``Step.commit``), and a takeover of them ends with it (committed, its end is known);
    a step not written here yet (another save of it, staged again since) is left as it
    is."""
    budgets = self._budgets()
    with self._lock:
      own = self._steps.get(final_dir)
      held = [r for r in self._replicas.values() if r.final_dir == final_dir]
      if own is not None and not own.view().written:
        log.info("step %d of %s: told it is committed while %s here; left as it is",
                 own.step, own.directory, own.state.value, extra={"step": own.step})
        own = None
      if own is None and not held:
        return []
      self._committed_dirs.pop(final_dir, None)  # to the end: the newest commit
      self._committed_dirs[final_dir] = True
      for r in held:
        r.commit()
      if own is not None:
        own.commit()  # (a takeover pending ends with it)
      return self._evict(own.directory if own is not None else held[0].directory, budgets)

  def keep_manifest(self, final_dir: str, manifest: Manifest) -> None:
    """A DCP step's ``manifest``, kept with the step and the replicas held of
    ``final_dir`` (``info`` answers it)."""
    with self._lock:
      for held in self._copies_of(final_dir):
        held.keep_manifest(manifest)

  def held(self, directory: str) -> Held:
    """What this host holds of the committed items under ``directory``, per item: its own
    shards, and the whole, committed replicas of other hosts' by source."""
    with self._lock:
      own = {s.final_dir: tuple(s.shards)
             for s in self._steps.values() if s.directory == directory and s.committed}
      replicas: dict[str, dict[int, tuple[ShardId, ...]]] = {}
      for r in self._replicas.values():
        if r.directory == directory and r.whole and r.committed:
          replicas.setdefault(r.final_dir, {})[r.source] = tuple(r.shards)
    return Held(own, replicas)

  def expire_uncommitted(self) -> list[int]:
    """Drops the steps written here (or whose write failed) whose commit (or abort) has
    not come in time; returns them."""
    now = time.monotonic()
    with self._lock:
      stale = [s for s in self._steps.values() if s.view().uncommitted
               and now - (s.finished or now) >= self.uncommitted_s]
      held = [sum(x.data.nbytes for x in s.staged()) for s in stale]
      for s in stale:
        del self._steps[s.final_dir]
        s.drop()  # the staged blocks go back to the arena
    for s, nbytes in zip(stale, held, strict=True):
      ago = now - (s.finished or now)
      if s.error is None:
        log.warning("step %d of %s was staged and written %.0f s ago but never committed (the "
                    "controller that staged it is gone?): its %s are freed", s.step,
                    s.directory, ago, shm.format_size(nbytes), extra={"step": s.step})
        continue
      freed = (f"its {shm.format_size(nbytes)} are freed" if nbytes else
               "its record goes now (its bytes went back at that failure)")
      log.warning("step %d of %s: its write failed %.0f s ago (%s: %s) and it was never "
                  "aborted (the controller that staged it is gone?): %s", s.step, s.directory,
                  ago, type(s.error).__name__, s.error, freed, extra={"step": s.step})
    return [s.step for s in stale]

  def _listed(self) -> tuple[list[Step], list[Replica]]:
    """Its steps, and its whole, committed replicas (what ``status``/``usage`` list)."""
    with self._lock:
      return list(self._steps.values()), [r for r in self._replicas.values()
                                          if r.whole and r.committed]

  def status(self) -> list[pb.CheckpointStatus]:
    """Per directory: the steps in the RAM tier and those still being written, each in
    the lists its view names (``lifecycle.VIEWS``)."""
    steps, held = self._listed()
    out: dict[str, pb.CheckpointStatus] = {}
    for s in sorted(steps, key=lambda s: s.step):
      entry = out.setdefault(s.directory, pb.CheckpointStatus(directory=s.directory))
      view = s.view()
      for name in view.lists:
        getattr(entry, name).append(s.step)
      if view.writing:
        entry.written_bytes += s.written
        entry.total_bytes += s.nbytes
        entry.writing_s = max(entry.writing_s, time.monotonic() - s.started)
    by_source: dict[tuple[str, int], pb.ReplicaSteps] = {}
    for r in sorted(held, key=lambda r: (r.source, r.step)):
      entry = out.setdefault(r.directory, pb.CheckpointStatus(directory=r.directory))
      steps_of = by_source.get((r.directory, r.source))
      if steps_of is None:
        steps_of = by_source[(r.directory, r.source)] = entry.replicas.add(source_host=r.source)
      steps_of.steps.append(r.step)
      steps_of.nbytes += r.nbytes
    return list(out.values())

  def usage(self) -> dict[str, int]:
    """Steps and bytes in the RAM tier (own, replicas) and being written, for the metrics."""
    steps, held = self._listed()
    own = [s for s in steps if s.committed]
    writing = [s for s in steps if s.view().writing]
    return {"ram_steps": len(own), "ram_bytes": sum(s.nbytes for s in own),
            "replica_steps": len(held), "replica_bytes": sum(r.nbytes for r in held),
            "writing_steps": len(writing),
            "writing_bytes": sum(max(s.nbytes - s.written, 0) for s in writing)}

  def group_use(self) -> dict[str, tuple[int, int]]:
    """Per group: its saves in progress here (staged, being written or waiting for their
    commit) and the bytes its committed steps (own shards and replicas) hold."""
    out: dict[str, tuple[int, int]] = {}
    with self._lock:
      copies: list[Step | Replica] = [*self._steps.values(), *self._replicas.values()]
      for held in copies:
        group = self._groups.get(self._resolve(held.directory))
        if group is None:
          continue
        saves, nbytes = out.get(group, (0, 0))
        if held.committed:
          nbytes += held.nbytes
        elif isinstance(held, Step) and held.view().saving:
          saves += 1
        out[group] = (saves, nbytes)
    return out

  # ---- directories and budgets ----------------------------------------------

  def configure(self, directory: str, ram_steps: int, ram_budget: int | None) -> None:
    """Keeps the newest ``ram_steps`` committed steps of ``directory`` within
    ``ram_budget`` bytes (None: no bound) from its next commit on."""
    with self._lock:
      self._ram_steps[directory] = (ram_steps, ram_budget)

  def set_group(self, directory: str, group: str) -> None:
    """``directory``'s committed steps count in ``group``'s budget (a pool tenant's)."""
    with self._lock:
      self._groups[os.path.realpath(directory)] = group

  def evict(self, directory: str) -> list[int]:
    """Keeps the newest ``ram_steps`` committed steps of ``directory`` within the budget,
    counting this host's own shards and the replicas it holds, then the newest committed
    steps of its group within the group's budget; returns the kept steps of ``directory``."""
    budgets = self._budgets()
    with self._lock:
      return self._evict(directory, budgets)

  def drop(self, steps: Iterable[tuple[str, int]], *, timeout: float = -1) -> bool:
    """Forgets each committed step's own shards and replicas here, by (directory, step)
    (a step committed no more, staged again since, stays); their arena blocks go back as
    their views die. False where its lock is busy for ``timeout`` s (-1: waits), then
    nothing goes."""
    if not self._lock.acquire(timeout=timeout):
      return False
    try:
      for directory, step in steps:
        self._drop(directory, step)
    finally:
      self._lock.release()
    return True

  def release(self, directories: Collection[str]) -> int:
    """Drops the committed steps (own shards and replicas) of ``directories`` (resolved);
    returns how many steps went."""
    with self._lock:
      steps = {(c.directory, c.step) for c in self._committed()
               if os.path.realpath(c.directory) in directories}
      for directory, step in steps:
        self._drop(directory, step)
    return len(steps)

  def clear(self) -> None:
    """Drops every step and replica held (a test's end)."""
    with self._lock:
      for own in self._steps.values():
        own.drop()
      self._steps.clear()
      self._replicas.clear()

  def _budgets(self) -> dict[str, int | None]:
    """Each group's budget now (``group_budget``: the pool's code, run outside the lock)."""
    with self._lock:
      groups = set(self._groups.values())
    return {group: self._group_budget(group) for group in groups}

  def _evict(self, directory: str, budgets: dict[str, int | None]) -> list[int]:
    """:meth:`evict`, each group within its budget in ``budgets``; the lock is held."""
    kept = self._evict_directory(directory)
    group = self._groups.get(self._resolve(directory))
    if group is None:
      return kept
    self._evict_group(group, budgets.get(group))
    held = {c.step for c in self._committed() if c.directory == directory}
    return [step for step in kept if step in held]

  def _committed(self) -> list[Step | Replica]:
    """The committed copies held, own shards and replicas; the lock is held."""
    copies: list[Step | Replica] = [*self._steps.values(), *self._replicas.values()]
    return [c for c in copies if c.committed]

  def _resolve(self, directory: str) -> str:
    resolved = self._resolved.get(directory)
    if resolved is None:
      resolved = self._resolved[directory] = os.path.realpath(directory)
    return resolved

  def _evict_group(self, group: str, budget: int | None) -> None:
    """Keeps the newest committed steps (by commit) of ``group``'s directories within its
    ``budget`` (None: no bound), own shards and replicas counted together; drops the rest.
    The lock is held."""
    if budget is None:
      return
    size: dict[str, tuple[str, int, int]] = {}  # final_dir -> (directory, step, bytes)
    for held in self._committed():
      if self._groups.get(self._resolve(held.directory)) == group:
        _, _, nbytes = size.get(held.final_dir, (held.directory, held.step, 0))
        size[held.final_dir] = (held.directory, held.step, nbytes + held.nbytes)
    used = 0
    for final_dir in reversed([d for d in self._committed_dirs if d in size]):
      directory, step, nbytes = size[final_dir]
      if used + nbytes <= budget:
        used += nbytes
        continue
      self._drop(directory, step)
      log.info("step %d of %s leaves the RAM tier of host %d: its %s would pass the RAM-tier "
               "quota of %r (%s, its newer steps first); its durable copy stays", step,
               directory, self.host_id, shm.format_size(nbytes), group, shm.format_size(budget),
               extra={"step": step})

  def _evict_directory(self, directory: str) -> list[int]:
    keep, budget = self._ram_steps.get(directory, (1, None))
    size: dict[int, int] = {}
    for c in self._committed():
      if c.directory == directory:
        size[c.step] = size.get(c.step, 0) + c.nbytes
    kept, used = [], 0
    for step in sorted(size, reverse=True):
      if len(kept) < keep and (budget is None or used + size[step] <= budget):
        kept.append(step)
        used += size[step]
      else:
        self._drop(directory, step)
    return sorted(kept)

  def _drop(self, directory: str, step: int) -> None:
    """:meth:`drop`; the lock is held."""
    for final_dir, s in list(self._steps.items()):
      if s.directory == directory and s.step == step and s.committed:
        del self._steps[final_dir]
        if final_dir in self._committed_dirs:  # a replica still on its way is dropped on arrival
          self._committed_dirs[final_dir] = False
        s.drop()
    for key, r in list(self._replicas.items()):
      if r.directory == directory and r.step == step:
        del self._replicas[key]
        if r.final_dir in self._committed_dirs:
          self._committed_dirs[r.final_dir] = False

  # ---- replicas ---------------------------------------------------------------

  def open_replica(self, directory: str, step: int, final_dir: str, source: int) -> Replica:
    """A new replica of ``final_dir`` from host ``source`` (receive): it replaces one of
    the same step and source that is not whole at once, and a whole one only once whole
    itself (:meth:`replica_whole`), so a resend that breaks leaves the old copy."""
    with self._lock:
      old = self._replicas.get((final_dir, source))
      held = old is not None and old.whole
      replica = Replica(directory, step, final_dir, source, replaces=old if held else None)
      if not held:
        self._replicas[(final_dir, source)] = replica
    return replica

  def add_replica_shard(self, replica: Replica, key: ShardId, data: np.ndarray) -> None:
    """A whole shard of ``replica`` (``Replica.add_shard``)."""
    with self._lock:
      replica.add_shard(key, data)

  def replica_piece(self, replica: Replica, key: ShardId, make: Callable[[], np.ndarray]
                    ) -> list:
    """``Replica.piece_block``: ``make`` makes the block at its first piece outside the
    lock (an arena's allocation, which may ask the tier to give way)."""
    with self._lock:
      entry = replica.piece_block(key)
    if entry is None:
      block = make()
      with self._lock:
        entry = replica.piece_block(key, block)
    assert entry is not None
    return entry

  def replica_piece_received(self, replica: Replica, key: ShardId, entry: list,
                             nbytes: int) -> bool:
    """``Replica.piece_received``."""
    with self._lock:
      return replica.piece_received(key, entry, nbytes)

  def replica_whole(self, replica: Replica) -> bool:
    """Its sender sent all of ``replica``: it replaces the whole one it was sent again of,
    and is committed (then kept within the budget) or dropped as its step's commit went
    meanwhile. Whether it is held (not aborted or evicted while it came)."""
    final_dir, source = replica.final_dir, replica.source
    budgets = self._budgets()
    with self._lock:
      replica.mark_whole()
      held = self._replicas.get((final_dir, source))
      if held is not None and held is replica.replaces:  # a resend: the newer copy wins
        self._replicas[(final_dir, source)] = replica
        replica.take_place_of(held)
        log.info("step %d: host %d's replica, sent again, replaces the one held",
                 replica.step, source, extra={"step": replica.step})
      elif held is not replica:
        return False  # aborted or evicted while it came
      fate = self._committed_dirs.get(final_dir)
      if fate is not None:  # its step committed before the replica was whole
        replica.commit()
        if fate:
          self._evict(replica.directory, budgets)
        else:
          del self._replicas[(final_dir, source)]
    return True

  def discard_partial(self, replica: Replica) -> None:
    """Forgets ``replica`` if it is not whole, and only it: not a newer stream's."""
    key = (replica.final_dir, replica.source)
    with self._lock:
      if self._replicas.get(key) is replica and not replica.whole:
        del self._replicas[key]  # its blocks go back to the arena
