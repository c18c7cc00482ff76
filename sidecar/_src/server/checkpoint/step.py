"""One step on this sidecar: this host's share of it, from its first Stage to its drop.

A :class:`Step` is the sidecar's one object for a step it staged: its shards (each a
``records.Staged``, the shard's record with its bytes beside it: the RAM tier's copy),
its write's outcome, whether the sidecars took it over, and its replication. What it
holds changes only through the methods below, each called from one module; nothing else
assigns it. Its state (``lifecycle.State``: where it is)::

    STAGING --take(last)--> STAGED --end_write(records)--> WRITTEN --commit()--> COMMITTED
       |                      |                               |                      |
       +--end_write(error)----+--> FAILED                     |                      |
       |                      |       |                       |                      |
       +----------------------+-------+--------drop()---------+----------------------+--> DROPPED

- ``take`` (``save.StepWriter.stage``, each Stage): adds a trainer's shards; the last part
  of every writer makes it STAGED (whole: no more shards come).
- ``end_write`` (``write.write_step``, its writer thread): WRITTEN with the shards'
  records as written (crc32c set), or FAILED with the write's error. A step dropped
  meanwhile (aborted mid-write) stays DROPPED: the outcome is only recorded.
- ``commit`` (``ram_tier.RamTier.mark_committed``): WRITTEN to COMMITTED, once; again is
  nothing. A takeover pending ends with it, in the same transition (committed, its end is
  known).
- ``drop`` (``ram_tier.RamTier``: evicted, expired, aborted, abandoned, replaced, a write
  failed mid-stage with its trainers gone): its bytes go back to the arena (as their last
  views die), its replication is cancelled, and a writer still waiting for shards is
  stopped. ``let_go`` (``write.write_step``): the same bytes go, the step kept FAILED.

Beside its state, three things run along with it:

- **its takeover** (``lifecycle.Takeover``, ``agreement.Agreements``): NONE, then PENDING by
  ``take_over`` once STAGED with its writers' plans (NONE again by ``refuse_takeover`` if
  the committer refused it), ENDED once its agreement's end is known here: the
  agreement's ``ended`` event, which ``take_over`` hands it (the step keeps no copy of
  it), set as the sidecars commit or abandon it (``agreement.Agreements._decide``) or by
  ``commit`` once it is committed here (``ram_tier.RamTier.mark_committed``), whether or
  not its trainers are there. Only the step holds whether it was taken over.
- **replication** (``replication.Replicator``): ``start_replication`` once STAGED (once
  per step), its ``copies.Replication`` ending ``succeeded`` or ``failed``, cancelled by
  ``drop`` and ``stop``.
- **its commit on storage and its abort**, one at a time: ``commit_gate.CommitGate``.

A transition from a state it does not leave raises :class:`StateError` (an internal
error: a caller's bug, never a client's).

Outside this module, code reads a step's ``state``, its ``takeover`` and its ``view()``,
never how they are kept: ``lifecycle.VIEWS`` projects each (state, write's outcome,
takeover) to every outside view of it, and :meth:`Step.view` reads it.

Threads: the gRPC handlers (``take``, ``commit``, ``drop``), the step's writer (``arrivals``,
``count_written``, ``end_write``), the agreement's threads (``take_over``, ``refuse_takeover``),
the RAM tier's yield and its reaper (``drop``) and the replication (``start_replication``,
``staged``). Each step's ``_lock`` guards its state and its shards; it is a leaf (nothing that
takes a lock is called while it is held: only the format's numbering of a Stage's shards runs
under it), so any other lock, the RAM tier's first, may be held around it. The RAM tier takes
its own lock around every ``drop`` (which steps it holds changes with it), and one Stage at
a time holds, checks and takes a step (``RamTier.slot``, a lock of the Stages' own, taken
before the tier's). Waiting is on events: ``wait_written``, ``wait_whole``, ``wait_agreed``. What
is set once at the start (its directory, step, paths, format, numbering) is read-only.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from sidecar._src.ckptfmt.format import Numbering
from sidecar._src.ckptfmt.records import CommitPlan, ShardId, ShardRecord, Staged
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.core import errors
from sidecar._src.server.checkpoint.commit_gate import CommitGate
from sidecar._src.server.checkpoint.copies import Replication, StepCopy
from sidecar._src.server.checkpoint.lifecycle import VIEWS, Outcome, State, Takeover, View


class StateError(errors.SidecarError, RuntimeError):
  """A transition from a state a step does not leave that way: a bug of its caller."""


class _Bytes(Mapping[ShardId, np.ndarray]):
  """A step's shards' bytes by id: a read-only view of its one map (no copy)."""
  __slots__ = ("_staged",)

  def __init__(self, staged: dict[ShardId, Staged]):
    self._staged = staged

  def __getitem__(self, key: ShardId) -> np.ndarray:
    return self._staged[key].data

  def __contains__(self, key: object) -> bool:
    return key in self._staged

  def __iter__(self) -> Iterator[ShardId]:
    return iter(self._staged)

  def __len__(self) -> int:
    return len(self._staged)


class Step(StepCopy):
  """One step this sidecar staged: its shards (the RAM tier's copy) and how far it got.

  Args:
    directory: the checkpoint directory; ``step``: its number.
    final_dir: the committed item directory: its key in the RAM tier.
    tmp_dir: the uncommitted item directory its writer fills.
    writers: the trainer processes of this host that stage it (the sessions that may).
    format: its format's name (``ckptfmt/registry.py``).
    numbering: how its format numbers its staged shards (the leaves, or a DCP rank's items).
  """

  def __init__(self, directory: str, step: int, final_dir: str, *, tmp_dir: str = "",
               writers: int = 1, format: str = "orbax",  # noqa: A002 - the wire's field
               numbering: Numbering | None = None):
    # Its shards, each record with its bytes (the one map of the RAM tier's copy), and its
    # view by id (``shards``: the dict is never replaced).
    self._staged: dict[ShardId, Staged] = {}
    super().__init__(directory, step, final_dir, _Bytes(self._staged))
    self._tmp_dir, self._writers, self._format = tmp_dir, max(writers, 1), format
    self._numbering = numbering
    self._started = time.monotonic()
    self._lock = threading.Lock()
    self._state = State.STAGING
    # Shards on their way to the writer (as the numbering made them); None once all are.
    self._incoming: queue.SimpleQueue = queue.SimpleQueue()
    self._lasts = 0  # the writers that sent their last part
    self._whole = False  # every writer's last part came (STAGED, then on)
    # Set once whole, or once the write ended or the save was dropped: no more parts come.
    self._whole_event = threading.Event()
    self._owners: set[str] = set()  # the handshake sessions that staged it
    # Its leaves, as its first part named them (what a commit by the sidecars lists).
    self._leaves: tuple[LeafSpec, ...] = ()
    # Whether each trainer that staged a part of it is there, by its worker session.
    self._stagers: dict[str, Callable[[], bool]] = {}
    self._plans: list[CommitPlan] = []  # the plans its writers' last parts carried
    # The write's end: its records as written, or its error.
    self._written_event = threading.Event()
    self._written_records: list[ShardRecord] = []
    self._error: BaseException | None = None
    self._outcome = Outcome.NONE  # how its write ended (kept through a drop)
    self._written = 0  # bytes written so far
    self._finished: float | None = None  # time.monotonic() when its write ended
    # Its agreement's end (``Agreement.ended``) once taken over: set by the agreement once
    # the sidecars committed or abandoned it, or by its commit here.
    self._agreed: threading.Event | None = None
    self._replication: Replication | None = None
    self.commit_gate = CommitGate(step, final_dir)  # its commit and its abort, one at a time

  def __repr__(self) -> str:
    return f"Step({self._final_dir!r}, step={self._step}, {self._state.name})"

  # ---- what it is (read-only) ------------------------------------------------

  @property
  def tmp_dir(self) -> str:
    return self._tmp_dir

  @property
  def writers(self) -> int:
    return self._writers

  @property
  def format(self) -> str:
    return self._format

  @property
  def numbering(self) -> Numbering | None:
    return self._numbering

  @property
  def started(self) -> float:
    return self._started

  # ---- where it is -----------------------------------------------------------

  @property
  def state(self) -> State:
    return self._state

  @property
  def takeover(self) -> Takeover:
    """Whether the sidecars took it over, and whether its end is known here."""
    agreed = self._agreed
    if agreed is None:
      return Takeover.NONE
    return Takeover.ENDED if agreed.is_set() else Takeover.PENDING

  def view(self) -> View:
    """How the outside sees it now (``lifecycle.VIEWS``)."""
    with self._lock:
      return VIEWS[(self._state, self._outcome, self.takeover is Takeover.PENDING)]

  @property
  def committed(self) -> bool:
    return self._state is State.COMMITTED

  @property
  def error(self) -> BaseException | None:
    """Its write's error, once it ended so (its view's ``agree`` is FAILED)."""
    return self._error

  @property
  def written_records(self) -> list[ShardRecord]:
    """Its shards' records as written (crc32c set), once written."""
    return self._written_records

  @property
  def finished(self) -> float | None:
    return self._finished

  @property
  def written(self) -> int:
    return self._written

  def staged(self) -> list[Staged]:
    """Its shards, each record with its bytes (a list of its own)."""
    with self._lock:
      return list(self._staged.values())

  @property
  def owners(self) -> frozenset[str]:
    """The handshake sessions that staged it (at most ``writers``)."""
    with self._lock:
      return frozenset(self._owners)

  @property
  def leaves(self) -> tuple[LeafSpec, ...]:
    return self._leaves

  @property
  def plans(self) -> tuple[CommitPlan, ...]:
    return tuple(self._plans)

  @property
  def replication(self) -> Replication | None:
    return self._replication

  def trainers_alive(self) -> bool | None:
    """Whether a trainer that staged a part of it is still there (None: not known)."""
    with self._lock:
      stagers = list(self._stagers.values())
    if not stagers:
      return None
    return any(alive() for alive in stagers)

  def wait_written(self, timeout: float | None) -> bool:
    """Waits for its write's end; whether it ended."""
    return self._written_event.wait(timeout)

  def wait_whole(self, timeout: float | None) -> bool:
    """Waits, where one of its writers sent its last part, for the others'; whether no
    more parts come (whole, or its write ended, or dropped)."""
    if self._lasts:
      return self._whole_event.wait(timeout)
    return self._whole_event.is_set()

  def wait_agreed(self, timeout: float | None) -> bool:
    """Waits for the end of the sidecars' agreement on it (taken over); whether known."""
    agreed = self._agreed
    return agreed is None or agreed.wait(timeout)

  # ---- transitions -------------------------------------------------------------

  def _move(self, to: State, *, legal: tuple[State, ...]) -> None:
    """The lock is held."""
    if self._state not in legal:
      raise StateError(
          f"step {self._step} at {self._final_dir!r:.200} is {self._state.value}: it cannot "
          f"become {to.value} (only from {', '.join(p.value for p in legal)})")
    self._state = to

  def take(self, owner: str, extra: Any, shards: Sequence[Staged], *, last: bool,
           writers: int, plan: CommitPlan | None = None, leaves: Sequence[LeafSpec] = (),
           worker: str = "", alive: Callable[[], bool] | None = None) -> bool:
    """One Stage of ``owner``'s (``save.StepWriter.stage``): its shards, numbered by the
    step's format (``extra``, the format's stage extra), go to the writer; ``last``: the
    owner's last part (with ``plan``, the sidecars commit the step), which makes it
    STAGED once ``writers`` sent theirs. Returns whether it is whole now.

    Raises:
      InvalidArgumentError: a shard's number (the format's ``Numbering.take``); nothing of
        this part is taken then. StateError: not STAGING.
    """
    with self._lock:
      if self._state is not State.STAGING:
        raise StateError(f"step {self._step} at {self._final_dir!r:.200} is "
                         f"{self._state.value}: it takes no more parts (only while staging)")
      self._owners.add(owner)
      if leaves and not self._leaves:
        self._leaves = tuple(leaves)
      if alive is not None:
        self._stagers[worker] = alive
      assert self._numbering is not None
      for n in self._numbering.take(extra, shards):
        self._staged[n.record.id] = n
        self._nbytes += n.data.nbytes
        self._incoming.put(n)
      if not last:
        return False
      self._lasts += 1
      if plan is not None:
        self._plans.append(plan)
      if self._lasts < writers:
        return False
      self._move(State.STAGED, legal=(State.STAGING,))
      self._whole = True
      self._incoming.put(None)
    self._whole_event.set()
    return True

  def arrivals(self, timeout: float) -> Iterator[Staged]:
    """The writer's (``write.write_step``): the shards as they are staged, till the last.

    Raises:
      DeadlineExceededError: none came for ``timeout`` s; or why it was stopped (``stop``,
        ``drop``).
    """
    while True:
      try:
        shard = self._incoming.get(timeout=timeout)
      except queue.Empty:
        raise errors.DeadlineExceededError(
            f"step {self._step}: no part staged for {timeout:g} s; the trainer stopped "
            "mid-save") from None
      if shard is None:
        return
      if isinstance(shard, BaseException):
        raise shard
      yield shard

  def count_written(self, nbytes: int) -> None:
    """The writer's: ``nbytes`` more written (only its thread counts)."""
    self._written += nbytes

  def end_write(self, records: list[ShardRecord] | None = None, *,
                error: BaseException | None = None) -> State:
    """The writer's: WRITTEN with ``records`` (from STAGED), or FAILED with ``error``
    (from STAGING or STAGED); a step dropped meanwhile stays DROPPED, its outcome kept.
    Returns the state it left (STAGING: it failed before it was whole)."""
    with self._lock:
      left = self._state
      if self._written_event.is_set():
        raise StateError(f"step {self._step} at {self._final_dir!r:.200}: its write ended "
                         "already")
      if self._state is not State.DROPPED:
        if error is None:
          self._move(State.WRITTEN, legal=(State.STAGED,))
        else:
          self._move(State.FAILED, legal=(State.STAGING, State.STAGED))
      self._error = error
      self._outcome = Outcome.WRITTEN if error is None else Outcome.FAILED
      self._written_records = records if records is not None else []
      self._finished = time.monotonic()
    self._written_event.set()
    self._whole_event.set()
    return left

  def commit(self) -> None:
    """``ram_tier.RamTier.mark_committed``'s: WRITTEN to COMMITTED (again: nothing). A
    takeover pending ends with it (committed here, its end is known)."""
    with self._lock:
      if self._state is not State.COMMITTED:
        self._move(State.COMMITTED, legal=(State.WRITTEN,))
      if self._agreed is not None:
        self._agreed.set()

  def drop(self, why: BaseException | None = None) -> None:
    """``ram_tier.RamTier``'s: DROPPED, from any state but DROPPED. Its bytes go back to the
    arena (as their last views die), its replication is cancelled, and a writer still
    waiting for its shards stops with ``why`` (a ClosedError by default)."""
    with self._lock:
      self._move(State.DROPPED, legal=(State.STAGING, State.STAGED, State.WRITTEN,
                                       State.FAILED, State.COMMITTED))
      ended = self._written_event.is_set()
      self._staged.clear()
    self.stop(why if why is not None else errors.ClosedError(
        f"the save of step {self._step} was aborted"))  # (its writer, if still staging)
    if ended:  # no writer reads them any more
      _drain(self._incoming)
    self._whole_event.set()

  def let_go(self) -> None:
    """The writer's, for a step that FAILED before it was whole, kept for its trainers to
    learn why: its bytes go back now, not at an abort that may never come (it expires)."""
    with self._lock:
      if self._state is not State.FAILED:
        raise StateError(f"step {self._step} at {self._final_dir!r:.200} is "
                         f"{self._state.name}: only a failed step lets its bytes go so")
      self._staged.clear()
    _drain(self._incoming)

  def stop(self, why: BaseException) -> None:
    """The sidecar stops (``checkpoints.Checkpoints.close``): its replication is cancelled
    and a writer still waiting for shards stops with ``why`` (then FAILED)."""
    with self._lock:
      staging = not self._whole and not self._written_event.is_set()
      replication = self._replication
    if replication is not None:
      replication.cancel()
    if staging:
      self._incoming.put(why)

  def take_over(self, ended: threading.Event) -> None:
    """``agreement.Agreements.take_over``'s: the sidecars commit it from now on (once
    whole; once); ``ended``: its agreement's end (``Agreement.ended``), which its
    takeover reads from now on."""
    with self._lock:
      if not self._whole or self._agreed is not None:
        raise StateError(f"step {self._step} at {self._final_dir!r:.200} is "
                         f"{self._state.value}{', taken over already' if self._agreed else ''}:"
                         " only a whole step is taken over, once")
      self._agreed = ended

  def refuse_takeover(self) -> None:
    """The takeover failed (its committer refused or did not answer): as before it."""
    with self._lock:
      self._agreed = None

  def start_replication(self, make: Callable[[], Replication]) -> tuple[Replication, bool]:
    """``replication.Replicator``'s: its replication, made by ``make`` if it has none yet
    (once whole, not dropped); and whether it was made now."""
    with self._lock:
      if not self._whole or self._state is State.DROPPED:
        raise StateError(f"step {self._step} at {self._final_dir!r:.200} is "
                         f"{self._state.value}: only a whole step is replicated")
      if self._replication is not None:
        return self._replication, False
      self._replication = make()
      return self._replication, True


def _drain(incoming: queue.SimpleQueue) -> None:
  """Empties ``incoming`` (the shards it holds let their blocks go)."""
  while True:
    try:
      incoming.get_nowait()
    except queue.Empty:
      return
