"""The RAM tier of one sidecar: the steps it staged, the replicas it holds, its budgets.

Records: a :class:`Step` (this host's own shards of a step, and its write's outcome),
its :class:`Replication` (those shards on their way to the peers) and a
:class:`Replica` (the shards a peer sent here). :class:`RamTier` keeps them under one
lock: ``committed`` keeps the newest steps of a directory within its ``ram_steps`` and
``ram_budget`` (own shards and replicas counted together), and the newest committed steps of
a group of directories (a pool tenant's) within the group's budget; steps written but never
committed expire, and ``status``/``usage`` report what is held.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.format import Numbering
from sidecar._src.ckptfmt.records import (
  CommitPlan,
  Held,
  Manifest,
  ReplicaTarget,
  Replicated,
  ShardId,
  ShardRecord,
)
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.core import errors
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Step:
  """One step this sidecar staged: its shards (the RAM tier) and its write's outcome."""
  directory: str
  step: int
  final_dir: str  # the committed item directory: the key of the RAM tier
  shards: dict[ShardId, np.ndarray]
  nbytes: int
  # How its format numbers its staged shards (the leaves, or a DCP rank's items).
  numbering: Numbering | None = None
  # Staged shards on their way to the writer (as the numbering made them), None once all are.
  incoming: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
  closed: bool = False  # the last part is staged (of every writer)
  lasts: int = 0  # the writers (trainer processes) that sent their last part
  # Set once closed, or once the write ended or the save was aborted: no more parts come.
  whole: threading.Event = dataclasses.field(default_factory=threading.Event)
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  # Its shards' records as staged (their bytes are ``shards``'), and as written.
  records: dict[ShardId, ShardRecord] = dataclasses.field(default_factory=dict)
  written_records: list[ShardRecord] = dataclasses.field(default_factory=list)
  error: BaseException | None = None
  committed: bool = False
  started: float = dataclasses.field(default_factory=time.monotonic)
  written: int = 0
  replication: Replication | None = None
  finished: float | None = None  # time.monotonic() when its write ended
  tmp_dir: str = ""  # the uncommitted item directory its writer fills
  # The handshake sessions that staged it (at most ``writers``, the trainer processes of
  # this host): only they stage more parts of it, and commit it.
  owners: set = dataclasses.field(default_factory=set)
  writers: int = 1
  format: str = "orbax"  # its format's name (ckptfmt/registry.py)
  manifest: Manifest | None = None  # a DCP step's, told at its commit
  # Its leaves, as its first part named them (what a commit by the sidecars lists).
  leaves: tuple[LeafSpec, ...] = ()
  # Whether each trainer that staged a part of it is there, by its worker session.
  stagers: dict[str, Callable[[], bool]] = dataclasses.field(default_factory=dict)
  # The plans its writers' last parts carried (CommitPlan): the sidecars commit it.
  plans: list[CommitPlan] = dataclasses.field(default_factory=list)
  # Set once this host took the step over (whole, with a plan: ``agreement.py``), and set
  # done once the sidecars committed or abandoned it: till then it is in flight whether
  # or not its trainers are there.
  committing: threading.Event | None = None

  @property
  def commit_pending(self) -> bool:
    """Whether this host took the step over and does not know its end yet."""
    return self.committing is not None and not self.committing.is_set()

  def trainers_alive(self) -> bool | None:
    """Whether a trainer that staged a part of it is still there (None: not known)."""
    if not self.stagers:
      return None
    return any(alive() for alive in list(self.stagers.values()))


@dataclasses.dataclass
class Replication:
  """This host's shards of one step on their way to its peers."""
  peers: list[ReplicaTarget]
  bandwidth: int | None = None  # bytes per second, each peer's copy in turn
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
  result: Replicated | None = None
  error: BaseException | None = None
  tenant: str | None = None  # whose shards (its replicas carry it), as this sidecar knows


@dataclasses.dataclass
class Replica:
  """The shards of one step that a peer (``source``) sent here: a replica record."""
  directory: str
  step: int
  final_dir: str
  source: int
  shards: dict[ShardId, np.ndarray] = dataclasses.field(
      default_factory=dict)
  # Shards arriving inline, in chunks: (block, bytes received so far).
  partial: dict[ShardId, list] = dataclasses.field(
      default_factory=dict)
  nbytes: int = 0
  whole: bool = False  # the source sent everything
  committed: bool = False
  # A whole replica held of the same step and source, which this one (sent again)
  # replaces once whole.
  replaces: Replica | None = None
  manifest: Manifest | None = None  # a DCP step's, told at its commit


class RamTier:
  """The steps and replicas one sidecar (``host_id``) holds; ``lock`` guards them all."""

  def __init__(self, host_id: int, *, uncommitted_s: float,
               group_budget: Callable[[str], int | None] = lambda group: None):
    self.host_id = host_id
    self.uncommitted_s = uncommitted_s
    self.lock = threading.Lock()
    self.steps: dict[str, Step] = {}  # by committed item directory
    self.replicas: dict[tuple[str, int], Replica] = {}  # by (final_dir, source host)
    # Items committed() was told of, in the order of their commits: True while in the RAM
    # tier, False once evicted (a replica that arrives after its step's commit learns its
    # fate here).
    self.committed_dirs: dict[str, bool] = {}
    self.ram_steps: dict[str, tuple[int, int | None]] = {}  # directory -> (steps, budget)
    # Directories (resolved) -> the group they count in (a pool tenant), whose committed
    # steps together keep within ``group_budget(group)`` bytes (None: no bound).
    self.groups: dict[str, str] = {}
    self._group_budget = group_budget
    self._resolved: dict[str, str] = {}  # directory as given -> resolved

  def record(self, final_dir: str) -> Step:
    """The step staged here for ``final_dir``; InvalidArgumentError if there is none."""
    with self.lock:
      record = self.steps.get(final_dir)
    if record is None:
      raise errors.InvalidArgumentError(f"host {self.host_id} has not staged {final_dir}")
    return record

  def mark_committed(self, final_dir: str) -> list[int]:
    """Marks a step (own shards and replicas) committed; evicts steps beyond the budget.
    Returns the kept steps."""
    with self.lock:
      record = self.steps.get(final_dir)
      held = [r for r in self.replicas.values() if r.final_dir == final_dir]
      if record is None and not held:
        return []
      self.committed_dirs.pop(final_dir, None)  # to the end: the newest commit
      self.committed_dirs[final_dir] = True
      for r in held:
        r.committed = True
      if record is not None:
        record.committed = True
        if record.committing is not None:  # a step taken over: its end is known
          record.committing.set()
      return self.evict(record.directory if record is not None else held[0].directory)

  def held(self, directory: str) -> Held:
    """What this host holds of the committed items under ``directory``, per item: its own
    shards, and the whole, committed replicas of other hosts' by source."""
    with self.lock:
      own = {s.final_dir: tuple(s.shards)
             for s in self.steps.values() if s.directory == directory and s.committed}
      replicas: dict[str, dict[int, tuple[ShardId, ...]]] = {}
      for r in self.replicas.values():
        if r.directory == directory and r.whole and r.committed:
          replicas.setdefault(r.final_dir, {})[r.source] = tuple(r.shards)
    return Held(own, replicas)

  def expire_uncommitted(self) -> list[int]:
    """Drops the steps written here whose commit has not come in time; returns them."""
    now = time.monotonic()
    with self.lock:
      stale = [s for s in self.steps.values() if not s.committed and s.finished is not None
               and not s.commit_pending and now - s.finished >= self.uncommitted_s]
      for s in stale:
        del self.steps[s.final_dir]
    for s in stale:
      if s.replication is not None:
        s.replication.cancelled.set()
      s.shards.clear()  # the staged blocks go back to the arena
      log.warning("step %d of %s was staged and written %.0f s ago but never committed (the "
                  "controller that staged it is gone?): its %s are freed", s.step, s.directory,
                  now - (s.finished or now), shm.format_size(s.nbytes), extra={"step": s.step})
    return [s.step for s in stale]

  def status(self) -> list[pb.CheckpointStatus]:
    """Per directory: the steps in the RAM tier and those still being written."""
    with self.lock:
      steps = list(self.steps.values())
      held = [r for r in self.replicas.values() if r.whole and r.committed]
    out: dict[str, pb.CheckpointStatus] = {}
    for s in sorted(steps, key=lambda s: s.step):
      entry = out.setdefault(s.directory, pb.CheckpointStatus(directory=s.directory))
      if s.commit_pending:
        entry.committing.append(s.step)
      if s.committed:
        entry.ram_steps.append(s.step)
      elif s.done.is_set():
        if not s.commit_pending:
          entry.uncommitted.append(s.step)
      else:
        entry.writing.append(s.step)
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
    with self.lock:
      steps = list(self.steps.values())
      held = [r for r in self.replicas.values() if r.whole and r.committed]
    own = [s for s in steps if s.committed]
    writing = [s for s in steps if not s.committed and not s.done.is_set()]
    return {"ram_steps": len(own), "ram_bytes": sum(s.nbytes for s in own),
            "replica_steps": len(held), "replica_bytes": sum(r.nbytes for r in held),
            "writing_steps": len(writing),
            "writing_bytes": sum(max(s.nbytes - s.written, 0) for s in writing)}

  def group_use(self) -> dict[str, tuple[int, int]]:
    """Per group: its saves in progress here (staged, being written or waiting for their
    commit) and the bytes its committed steps (own shards and replicas) hold."""
    out: dict[str, tuple[int, int]] = {}
    with self.lock:
      records: list[Step | Replica] = [*self.steps.values(), *self.replicas.values()]
      for held in records:
        group = self.groups.get(self._resolve(held.directory))
        if group is None:
          continue
        saves, nbytes = out.get(group, (0, 0))
        if held.committed:
          nbytes += held.nbytes
        elif isinstance(held, Step) and held.error is None:
          saves += 1
        out[group] = (saves, nbytes)
    return out

  def evict(self, directory: str) -> list[int]:
    """Keeps the newest ``ram_steps`` committed steps of ``directory`` within the budget,
    counting this host's own shards and the replicas it holds, then the newest committed
    steps of its group within the group's budget; returns the kept steps of ``directory``.
    The lock is held."""
    kept = self._evict_directory(directory)
    group = self.groups.get(self._resolve(directory))
    if group is None:
      return kept
    self._evict_group(group)
    held = {s.step for s in self.steps.values() if s.directory == directory and s.committed}
    held |= {r.step for r in self.replicas.values() if r.directory == directory and r.committed}
    return [step for step in kept if step in held]

  def _resolve(self, directory: str) -> str:
    resolved = self._resolved.get(directory)
    if resolved is None:
      resolved = self._resolved[directory] = os.path.realpath(directory)
    return resolved

  def _evict_group(self, group: str) -> None:
    """Keeps the newest committed steps (by commit) of ``group``'s directories within its
    budget, own shards and replicas counted together; drops the rest. The lock is held."""
    budget = self._group_budget(group)
    if budget is None:
      return
    size: dict[str, tuple[str, int, int]] = {}  # final_dir -> (directory, step, bytes)
    records: list[Step | Replica] = [*self.steps.values(), *self.replicas.values()]
    for held in records:
      if held.committed and self.groups.get(self._resolve(held.directory)) == group:
        _, _, nbytes = size.get(held.final_dir, (held.directory, held.step, 0))
        size[held.final_dir] = (held.directory, held.step, nbytes + held.nbytes)
    used = 0
    for final_dir in reversed([d for d in self.committed_dirs if d in size]):
      directory, step, nbytes = size[final_dir]
      if used + nbytes <= budget:
        used += nbytes
        continue
      self.drop(directory, step)
      log.info("step %d of %s leaves the RAM tier of host %d: its %s would pass the RAM-tier "
               "quota of %r (%s, its newer steps first); its durable copy stays", step,
               directory, self.host_id, shm.format_size(nbytes), group, shm.format_size(budget),
               extra={"step": step})

  def _evict_directory(self, directory: str) -> list[int]:
    keep, budget = self.ram_steps.get(directory, (1, None))
    size: dict[int, int] = {}
    for s in self.steps.values():
      if s.directory == directory and s.committed:
        size[s.step] = size.get(s.step, 0) + s.nbytes
    for r in self.replicas.values():
      if r.directory == directory and r.committed:
        size[r.step] = size.get(r.step, 0) + r.nbytes
    kept, used = [], 0
    for step in sorted(size, reverse=True):
      if len(kept) < keep and (budget is None or used + size[step] <= budget):
        kept.append(step)
        used += size[step]
      else:
        self.drop(directory, step)
    return sorted(kept)

  def drop(self, directory: str, step: int) -> None:
    """Forgets the step's own shards and replicas here; their arena blocks go back as
    their views die. The lock is held."""
    for final_dir, s in list(self.steps.items()):
      if s.directory == directory and s.step == step and s.committed:
        del self.steps[final_dir]
        if final_dir in self.committed_dirs:  # a replica still on its way is dropped on arrival
          self.committed_dirs[final_dir] = False
        if s.replication is not None:
          s.replication.cancelled.set()
    for key, r in list(self.replicas.items()):
      if r.directory == directory and r.step == step:
        del self.replicas[key]
        if r.final_dir in self.committed_dirs:
          self.committed_dirs[r.final_dir] = False
