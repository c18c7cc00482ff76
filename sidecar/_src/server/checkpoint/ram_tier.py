"""The RAM tier of one sidecar: the steps it staged, the replicas it holds, its budgets.

It holds each ``step.Step`` (this host's own shards of a step, and how far the step got:
its phases are that module's) and each :class:`Replica` (the shards of a step another
sidecar sent here). :class:`RamTier` keeps them under one lock, and is the one place a
step enters (``add``) and leaves (``remove``, ``drop``, ``expire_uncommitted``) it:
``committed`` keeps the newest steps of a directory within its ``ram_steps`` and
``ram_budget`` (own shards and replicas counted together), and the newest committed steps of
a group of directories (a pool tenant's) within the group's budget; steps written but never
committed expire, and ``status``/``usage`` report what is held.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types
from collections.abc import Callable, Mapping

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.records import Held, Manifest, ShardId
from sidecar._src.core import errors
from sidecar._src.server.checkpoint.step import Phase, Step
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)


class Replica:
  """The shards of one step that another sidecar (host ``source``) sent here: a replica.

  Its state changes only through its methods, each called with the RAM tier's ``lock``
  held (``replication.Replicator`` receives it, :class:`RamTier` and
  ``checkpoints.Checkpoints`` mark it committed): its shards arrive whole
  (``add_shard``) or in pieces (``piece_block``, ``piece_received``); it is ``whole``
  once its sender said so (``mark_whole``), ``committed`` once its step is (``commit``,
  before or after it is whole). A replica sent again while a whole one is held
  ``replaces`` it once whole itself (``take_place_of``).
  """

  def __init__(self, directory: str, step: int, final_dir: str, source: int, *,
               replaces: Replica | None = None):
    self._directory, self._step, self._final_dir = directory, step, final_dir
    self._source = source
    self._shards: dict[ShardId, np.ndarray] = {}
    self._view = types.MappingProxyType(self._shards)
    # Shards arriving inline, in pieces: [block, bytes received so far].
    self._partial: dict[ShardId, list] = {}
    self._nbytes = 0
    self._whole = False  # the source sent everything
    self._committed = False
    # A whole replica held of the same step and source, which this one (sent again)
    # replaces once whole.
    self._replaces = replaces
    self._manifest: Manifest | None = None  # a DCP step's, told at its commit

  def __repr__(self) -> str:
    return f"Replica({self._final_dir!r}, source={self._source}, whole={self._whole})"

  @property
  def directory(self) -> str:
    return self._directory

  @property
  def step(self) -> int:
    return self._step

  @property
  def final_dir(self) -> str:
    return self._final_dir

  @property
  def source(self) -> int:
    return self._source

  @property
  def shards(self) -> Mapping[ShardId, np.ndarray]:
    """Its whole shards' bytes by id (a read-only view)."""
    return self._view

  @property
  def partial(self) -> int:
    """How many shards are still arriving in pieces."""
    return len(self._partial)

  @property
  def nbytes(self) -> int:
    return self._nbytes

  @property
  def whole(self) -> bool:
    return self._whole

  @property
  def committed(self) -> bool:
    return self._committed

  @property
  def replaces(self) -> Replica | None:
    return self._replaces

  @property
  def manifest(self) -> Manifest | None:
    return self._manifest

  def add_shard(self, key: ShardId, data: np.ndarray) -> None:
    """A whole shard (checked by its sender's crc32c), in place of one of the same id."""
    old = self._shards.get(key)
    self._nbytes += data.nbytes - (old.nbytes if old is not None else 0)
    self._shards[key] = data

  def piece_block(self, key: ShardId, make: Callable[[], np.ndarray]) -> list:
    """The block the shard ``key`` is assembled in from its pieces (``make`` makes it at
    its first piece), with the bytes received so far: ``[block, received]``."""
    entry = self._partial.get(key)
    if entry is None:
      entry = self._partial[key] = [make(), 0]
    return entry

  def piece_received(self, key: ShardId, entry: list, nbytes: int) -> bool:
    """``nbytes`` more of ``key``'s bytes are in its block (``entry``); whether the shard is
    whole now (then it is no longer arriving: the caller adds it)."""
    entry[1] += nbytes
    whole = entry[1] >= entry[0].nbytes
    if whole:
      self._partial.pop(key, None)
    return whole

  def mark_whole(self) -> None:
    """Its sender sent everything."""
    self._whole = True
    self._partial = {}

  def take_place_of(self, old: Replica) -> None:
    """It replaces ``old`` (the whole replica it was sent again of), committed as it was."""
    self._committed = self._committed or old.committed
    self._replaces = None

  def commit(self) -> None:
    """Its step is committed (before or after it is whole)."""
    self._committed = True

  def keep_manifest(self, manifest: Manifest) -> None:
    """A DCP step's manifest, kept with it (``info`` answers it)."""
    self._manifest = manifest


class RamTier:
  """The steps and replicas one sidecar (``host_id``) holds.

  ``lock`` guards which ones it holds, the replicas' fields and the budgets; a step's
  phase and shards are the step's own (``step.Step``, whose lock is taken inside this
  one): a step enters by :meth:`add` and leaves by :meth:`remove`, :meth:`remove_item`,
  :meth:`drop` or :meth:`expire_uncommitted`, each dropping it (``Step.drop``).
  """

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

  def step_at(self, final_dir: str) -> Step:
    """The step staged here for ``final_dir``; InvalidArgumentError if there is none."""
    with self.lock:
      own = self.steps.get(final_dir)
    if own is None:
      raise errors.InvalidArgumentError(f"host {self.host_id} has not staged {final_dir}")
    return own

  def add(self, own: Step) -> None:
    """``own`` (its first Stage's) in the tier, by its ``final_dir``: a step held there
    before (its write ended: a save of the same step again) is dropped. The lock is held."""
    old = self.steps.get(own.final_dir)
    self.steps[own.final_dir] = own
    if old is not None and old is not own:
      old.drop()

  def remove(self, own: Step, why: BaseException | None = None) -> bool:
    """Drops ``own`` (``Step.drop``, ``why`` to a writer still waiting for its shards) if
    it is still this tier's step of its ``final_dir``; whether it was."""
    with self.lock:
      ours = self.steps.get(own.final_dir) is own
      if ours:
        del self.steps[own.final_dir]
        own.drop(why)
    return ours

  def remove_item(self, final_dir: str, why: BaseException | None = None) -> Step | None:
    """Drops the step and the replicas of ``final_dir`` held here (a save aborted),
    ``why`` to a writer still waiting for its shards; returns the step, if one was here."""
    with self.lock:
      own = self.steps.pop(final_dir, None)
      for key in [k for k in self.replicas if k[0] == final_dir]:
        del self.replicas[key]
      if own is not None:
        own.drop(why)
    return own

  def mark_committed(self, final_dir: str) -> list[int]:
    """Marks a step (own shards and replicas) committed; evicts steps beyond the budget.
    Returns the kept steps. This host's own shards are marked once written here
    (``Step.commit``); a step not written here yet (another save of it, staged again
    since) is left as it is."""
    with self.lock:
      own = self.steps.get(final_dir)
      held = [r for r in self.replicas.values() if r.final_dir == final_dir]
      if own is not None and own.phase not in (Phase.WRITTEN, Phase.COMMITTED):
        log.info("step %d of %s: told it is committed while %s here; left as it is",
                 own.step, own.directory, own.phase.value, extra={"step": own.step})
        own = None
      if own is None and not held:
        return []
      self.committed_dirs.pop(final_dir, None)  # to the end: the newest commit
      self.committed_dirs[final_dir] = True
      for r in held:
        r.commit()
      if own is not None:
        own.commit()  # (a step taken over: its end is known)
      return self.evict(own.directory if own is not None else held[0].directory)

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
        s.drop()  # the staged blocks go back to the arena
    for s in stale:
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
      elif s.write_ended:
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
    writing = [s for s in steps if not s.committed and not s.write_ended]
    return {"ram_steps": len(own), "ram_bytes": sum(s.nbytes for s in own),
            "replica_steps": len(held), "replica_bytes": sum(r.nbytes for r in held),
            "writing_steps": len(writing),
            "writing_bytes": sum(max(s.nbytes - s.written, 0) for s in writing)}

  def group_use(self) -> dict[str, tuple[int, int]]:
    """Per group: its saves in progress here (staged, being written or waiting for their
    commit) and the bytes its committed steps (own shards and replicas) hold."""
    out: dict[str, tuple[int, int]] = {}
    with self.lock:
      copies: list[Step | Replica] = [*self.steps.values(), *self.replicas.values()]
      for held in copies:
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
    copies: list[Step | Replica] = [*self.steps.values(), *self.replicas.values()]
    for held in copies:
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
    """Forgets the committed step's own shards and replicas here; their arena blocks go
    back as their views die. The lock is held."""
    for final_dir, s in list(self.steps.items()):
      if s.directory == directory and s.step == step and s.committed:
        del self.steps[final_dir]
        if final_dir in self.committed_dirs:  # a replica still on its way is dropped on arrival
          self.committed_dirs[final_dir] = False
        s.drop()
    for key, r in list(self.replicas.items()):
      if r.directory == directory and r.step == step:
        del self.replicas[key]
        if r.final_dir in self.committed_dirs:
          self.committed_dirs[r.final_dir] = False
