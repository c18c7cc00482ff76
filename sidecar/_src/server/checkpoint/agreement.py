"""The sidecars' own commit of a step they took over: :class:`Agreements`.

Each trainer process sends, with its last part of a step on each host, the step's
``records.CommitPlan``: its committer (the host it was begun on), its hosts, its data
position. Once a host's part is whole (every process that stages into it sent its last
part) it *takes the step over*, before it answers the Stage that made it whole: from then on
the sidecars, not the trainers, bring the step to its end, whether the trainers live or
not. So once ``save()`` has returned on every trainer (its last Stages answered), the step
is committed even if every trainer dies at that moment. Over the sidecars' links
(``links.Links.agree``, the ``Agree`` rpc, sidecar to sidecar):

- a host other than the committer tells the committer at its takeover (TAKEN_OVER, in
  the Stage, before it answers; a committer that abandoned the save refuses it, and so
  does that Stage: the trainer's save fails), then its part's state every ``POLL_S`` (its
  heartbeat): WRITTEN with its written shards' records once its write ended, or FAILED
  with the write's error, until the committer answers its decision; it then marks its
  RAM tier (COMMITTED) or lets its part go (ABANDONED). A committer it cannot reach
  (its sidecar died) or that no longer knows the save: abandoned here.
- the committer waits for its own write and every host's WRITTEN, then commits (the
  manifest of every host's records, the format's rename: ``save.StepWriter.commit_agreed``)
  and marks its RAM tier. It abandons the save, and never lists it, when a host's write
  failed, when its trainers abort it, when a host it has not heard from for ``SILENT_S``
  does not answer (its sidecar is gone), or when the trainers that staged its own part
  are gone while a host never had its part whole (no trainer is left to stage it).

No half-written step is ever listed: the rename comes only after every host said its part
is written. A committer that dies before it leaves the step uncommitted (its tmp directory,
swept by the next ``open``); after it, committed (the other hosts then abandon their part of
it here, and a restore reads it from storage). The trainers, where they live, wait for the
decision (``Commit`` taken_over) and learn it as it is; an ``open`` waits for the steps
taken over here (``save.StepWriter.open``); ``Status`` lists them (``committing``) until
their end is known here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import grpc

from sidecar._src.ckptfmt.records import (
  AgreeState,
  CommitPlan,
  ReplicaTarget,
  ShardRecord,
  Standing,
)
from sidecar._src.core import errors
from sidecar._src.server.checkpoint import (
  faults,
  links as links_lib,
  ram_tier,
  save as checkpoint_save,
  step as step_lib,
  write as write_lib,
)

log = logging.getLogger(__name__)
POLL_S = 0.5  # a host's heartbeat to the committer, and how often the committer looks around
# A host unheard from this long (two of its heartbeats missed) is asked; one that does not
# answer is gone. Asking is cheap and decides nothing by itself (a live host answers), while
# every second here is a second that a save in flight at a host loss holds the trainer's
# next save (the trainer's controller knows the loss; this sidecar learns it only so).
SILENT_S = 1.0
CALL_S = 10.0  # the longest one Agree call waits
KEEP_S = 600.0  # how long a decided save is kept, for a host or a trainer that asks late


@dataclasses.dataclass
class HostState:
  """Another host's part of a save, as its committer knows it."""
  standing: Standing
  records: tuple[ShardRecord, ...] = ()
  error: BaseException | None = None
  heard: float = dataclasses.field(default_factory=time.monotonic)


class Agreement:
  """One save taken over, on one host: this host's part of it (``own``, until the end),
  the other hosts' states (``states``, on the committer), and the end (``decision``)."""

  def __init__(self, plan: CommitPlan, *, final_dir: str, step: int, directory: str,
               format: str):  # noqa: A002 - the wire's field
    self.plan, self.final_dir, self.step = plan, final_dir, step
    self.directory, self.format = directory, format
    self.own: step_lib.Step | None = None  # this host's part, till the end
    self.tmp_dir = ""  # this host's part's (a trainer's Commit names it)
    self.owners: frozenset[str] = frozenset()  # the sessions that staged this host's part
    self.states: dict[int, HostState] = {}
    self.decision: AgreeState | None = None
    # Set with the decision (``_decide``), or by its part's commit here (``Step.commit``):
    # what its part's takeover reads as ENDED (``step.Step.takeover``).
    self.ended = threading.Event()
    self.aborted: BaseException | None = None  # the trainers aborted it
    self.cond = threading.Condition()
    self.created = time.monotonic()
    self.decided_at = 0.0

  @property
  def key(self) -> tuple[str, str]:
    return self.final_dir, self.plan.save


class Agreements:
  """The saves this sidecar (``host_id``) took over or commits for others.

  Args:
    host_id: this sidecar's host.
    tier: its RAM tier (the parts, marked committed at the end).
    writer: its step writer (the commit, whether the trainers that began a save live).
    links: its links to the other sidecars for the agreements (:class:`AgreeLinks`);
      ``hosts``: where they are.
    spawn: starts a thread the owner joins.
    closed: set as the sidecar stops.
  """

  def __init__(self, host_id: int, *, tier: ram_tier.RamTier, writer: checkpoint_save.StepWriter,
               links: AgreeLinks, hosts: links_lib.ReplicaHosts,
               spawn: Callable[..., None], closed: threading.Event):
    self._host_id, self._tier, self._writer = host_id, tier, writer
    self._links, self._hosts, self._spawn, self._closed = links, hosts, spawn, closed
    self._saves: dict[tuple[str, str], Agreement] = {}
    self._lock = threading.Lock()

  # ---- a host takes a step over ------------------------------------------

  def take_over(self, own: step_lib.Step) -> None:
    """Takes over ``own``, whole with its writers' plans (``StepWriter.stage``, before
    the Stage that made it whole answers): the sidecars commit it from now on.

    Raises:
      InvalidArgumentError: its writers' plans disagree, or name a committer this sidecar
        has no address of; HostLostError: the committer is unreachable; ClosedError: the
        committer abandoned the save already. The Stage fails, and the trainer's save.
    """
    plan = _plan_of(own)
    mine = self._host_id == plan.committer
    a, made = self._get(plan, own)
    with a.cond:
      if a.decision is not None:
        raise _refused(a)
      if mine:  # its own writers' plan has the lead's data position (a host's may not)
        a.plan = plan
      a.own, a.tmp_dir, a.owners = own, own.tmp_dir, own.owners
      own.take_over(a.ended)
      a.cond.notify_all()
    log.info("step %d: taken over here (%d hosts, committed by host %d)", a.step,
             len(plan.hosts), plan.committer, extra={"step": a.step})
    if mine:
      if made:
        self._spawn(self._commit_when_agreed, a, name=f"sidecar-commit-{a.step}")
      return
    try:  # the committer knows of this part before the trainer hears it is staged
      try:
        answer = self._tell(plan.committer, self._state_of(a, announce=True))
      except errors.SidecarError as e:  # said in the Stage's error, which carries no note
        raise _with_text(e, f"host {self._host_id} could not take step {a.step} over (the "
                         f"sidecars commit it): its committer, host {plan.committer}, did "
                         f"not answer: {e}") from None
      if answer.standing.decided or answer.standing is Standing.UNKNOWN:
        with a.cond:
          a.decision = answer
        raise _refused(a)
    except BaseException:
      self._forget(a)
      own.refuse_takeover()
      raise
    self._spawn(self._follow, a, name=f"sidecar-agree-{a.step}")

  def _get(self, plan: CommitPlan, own: step_lib.Step) -> tuple[Agreement, bool]:
    """The agreement on ``plan``'s save here, and whether it was made now."""
    key = (own.final_dir, plan.save)
    with self._lock:
      self._prune()
      a = self._saves.get(key)
      if a is not None:
        return a, False
      a = self._saves[key] = Agreement(plan, final_dir=own.final_dir, step=own.step,
                                       directory=own.directory, format=own.format)
      return a, True

  def _forget(self, a: Agreement) -> None:
    with self._lock:
      if self._saves.get(a.key) is a:
        del self._saves[a.key]

  def _prune(self) -> None:
    """Forgets the saves decided more than ``KEEP_S`` ago (the lock is held)."""
    now = time.monotonic()
    for key in [k for k, a in self._saves.items()
                if a.decision is not None and now - a.decided_at > KEEP_S]:
      del self._saves[key]

  # ---- the committer -------------------------------------------------------

  def _commit_when_agreed(self, a: Agreement) -> None:
    """The committer's thread: commits once every host's part is written, or abandons."""
    try:
      shards = self._await_written(a)
      faults.fault("prepared", a.step)
      assert a.own is not None
      committed = self._writer.commit_agreed(a.own, shards, plan=a.plan)
      self._decide(a, Standing.COMMITTED, committed=committed)
      log.info("step %d: committed by the sidecars' agreement (%d hosts)", a.step,
               len(a.plan.hosts), extra={"step": a.step})
    except BaseException as e:
      e = e.with_traceback(None)
      self._decide(a, Standing.ABANDONED, error=e)
      level = logging.INFO if a.aborted is not None else logging.WARNING
      log.log(level, "step %d: abandoned by its committer, never listed: %s", a.step, e,
              extra={"step": a.step})

  def _await_written(self, a: Agreement) -> list[ShardRecord]:
    """Every host's written records, once all are written; raises why the save is
    abandoned (a failed write, the trainers' abort, a host gone, a part never whole)."""
    while True:
      with a.cond:
        if a.aborted is not None:
          raise a.aborted
        failed = next((p.error for p in a.states.values() if p.standing is Standing.FAILED), None)
        if failed is not None:
          raise failed
        own = a.own
        part = own.view().agree if own is not None else Standing.UNKNOWN
        if own is not None and part in (Standing.WRITTEN, Standing.FAILED):
          if part is Standing.FAILED:
            assert own.error is not None
            raise write_lib.write_failure(self._host_id, a.step, a.final_dir, own.error,
                                          tmp_dir=own.tmp_dir)
          written = {h for h, p in a.states.items() if p.standing is Standing.WRITTEN}
          if written | {self._host_id} >= set(a.plan.hosts):
            return [*own.written_records, *(r for p in a.states.values() for r in p.records)]
        missing = [h for h in a.plan.hosts if h not in a.states and h != self._host_id]
        missing += [self._host_id] if own is None else []
        now = time.monotonic()
        silent = [h for h, p in a.states.items()
                  if p.standing is Standing.TAKEN_OVER and now - p.heard > SILENT_S]
      self._look_around(a, missing, silent)
      if own is not None and part is Standing.TAKEN_OVER:
        own.wait_written(POLL_S)
      else:
        with a.cond:
          a.cond.wait(POLL_S)

  def _look_around(self, a: Agreement, missing: list[int], silent: list[int]) -> None:
    """Raises where the save can no longer be committed; asks the hosts gone silent. A
    stopping sidecar lets a write whose part is whole here finish (``Checkpoints.close``
    joins it): till it ends, the committer waits for it, then commits what is written."""
    own = a.own
    if self._closed.is_set() and (own is None or own.state is not step_lib.State.STAGED):
      raise errors.ClosedError(f"the sidecar of host {self._host_id} is stopping")
    begun = self._writer.begun(a.directory, a.step, a.format) if own is None else None
    alive = (own.trainers_alive() if own is not None
             else begun.alive() if begun is not None and begun.alive is not None else None)
    age = time.monotonic() - a.created
    if missing and (alive is False or (alive is None and own is None
                                       and age > write_lib.STAGE_TIMEOUT_S)):
      raise errors.ClosedError(
          f"step {a.step}: the trainers that staged it are gone, and host(s) {missing} never "
          "had their part whole: no trainer is left to stage it")
    if age > write_lib.LONG_WRITE_S:
      raise errors.DeadlineExceededError(
          f"step {a.step}: not written on every host after {write_lib.LONG_WRITE_S:g} s")
    for h in silent:
      try:
        answer = self._tell(h, self._state_of(a))
      except errors.HostLostError as e:
        raise errors.HostLostError(
            f"host {h}'s sidecar is gone before its part of step {a.step} was written: "
            f"{e}", host_id=h) from None
      except errors.SidecarError as e:  # busy, slow: asked again later
        log.info("step %d: host %d did not answer (%s); asked again", a.step, h, e)
        continue
      if answer.standing is Standing.UNKNOWN:
        raise errors.HostLostError(
            f"host {h} no longer knows step {a.step} (its sidecar restarted)", host_id=h)
      self._heard(a, answer)

  def _heard(self, a: Agreement, state: AgreeState) -> None:
    """Records another host's ``state`` (the committer's)."""
    with a.cond:
      if a.decision is not None:
        return
      old = a.states.get(state.host)
      records = state.records or (old.records if old is not None else ())
      a.states[state.host] = HostState(state.standing, records, state.error)
      a.cond.notify_all()

  def _decide(self, a: Agreement, standing: Standing, *, committed: str = "",
              error: BaseException | None = None) -> None:
    """The end of the save here: told to whoever asks, waits or follows."""
    with a.cond:
      if a.decision is not None:
        return
      a.decision = AgreeState(final_dir=a.final_dir, save=a.plan.save, step=a.step,
                              host=self._host_id, standing=standing, error=error,
                              committed=committed)
      a.decided_at = time.monotonic()
      own, a.own = a.own, None  # its arena blocks go with the RAM tier's copy
      a.cond.notify_all()
    if own is not None and standing is Standing.ABANDONED and own.trainers_alive() is False:
      self._tier.remove(own)  # nobody will abort it: its blocks go back now
    a.ended.set()  # its part's takeover ends (step.Takeover.ENDED)

  # ---- the other hosts ---------------------------------------------------

  def _follow(self, a: Agreement) -> None:
    """A host's thread (not the committer): tells the committer its part's state (at once
    once written, else every ``POLL_S``) until it answers its decision, then ends the part
    here."""
    own = a.own
    assert own is not None and own.takeover is not step_lib.Takeover.NONE
    sent_records = False  # the committer holds this part's written records
    while True:
      if own.view().agree is Standing.TAKEN_OVER:
        own.wait_written(POLL_S)
      elif sent_records:
        self._closed.wait(POLL_S)
      if own.takeover is not step_lib.Takeover.PENDING:  # committed here (Committed)
        self._decide(a, Standing.COMMITTED)
        return
      if a.aborted is not None or self._closed.is_set():
        return
      written = own.view().agree is not Standing.TAKEN_OVER
      if written and not sent_records:
        faults.fault("prepared", a.step)
      try:
        answer = self._tell(a.plan.committer, self._state_of(a, records=not sent_records))
      except errors.HostLostError as e:
        gone = errors.HostLostError(
            f"step {a.step}: its committer, host {a.plan.committer}, is gone: {e}",
            host_id=a.plan.committer)
        self._decide(a, Standing.ABANDONED, error=gone)
        log.warning("step %d: abandoned here, never listed by this host: %s", a.step, gone,
                    extra={"step": a.step})
        return
      except errors.SidecarError as e:  # busy, slow: told again
        log.info("step %d: host %d did not answer (%s); told again", a.step,
                 a.plan.committer, e)
        self._closed.wait(POLL_S)
        continue
      if answer.standing.decided or answer.standing is Standing.UNKNOWN:
        self._end(a, answer)
        return
      sent_records = written and self._host_id in answer.written
      if written and not sent_records:
        self._closed.wait(POLL_S)

  def _end(self, a: Agreement, answer: AgreeState) -> None:
    """Ends this host's part as the committer decided (unknown there: abandoned)."""
    own = a.own
    if answer.standing is Standing.COMMITTED and own is not None:
      if self._tier.find(own.final_dir) is own:  # still its part here
        self._tier.mark_committed(a.final_dir)
      self._decide(a, Standing.COMMITTED, committed=answer.committed)
      return
    error = answer.error or errors.HostLostError(
        f"its committer, host {a.plan.committer}, no longer knows the save (restarted)")
    self._decide(a, Standing.ABANDONED, error=error)
    log.warning("step %d: abandoned by the sidecars, never listed: %s", a.step, error,
                extra={"step": a.step})

  # ---- requests ----------------------------------------------------------

  def agree(self, state: AgreeState) -> AgreeState:
    """The ``Agree`` rpc: another host's ``state``; answers this host's. On the committer:
    records it (a TAKEN_OVER of a save it has no part of yet makes it), and answers its
    decision, or, till then, which hosts' written records it holds. On another host (the
    committer asking): its own part's state."""
    with self._lock:
      a = self._saves.get((state.final_dir, state.save))
      plan = state.plan
      # Told of a save it has no part of yet: one begun here (no part comes of one not).
      if (a is None and state.standing is Standing.TAKEN_OVER and plan is not None
          and plan.committer == self._host_id and state.host in plan.hosts
          and self._writer.begun(state.directory, state.step, state.format) is not None):
        a = self._saves[(state.final_dir, plan.save)] = Agreement(
            plan, final_dir=state.final_dir, step=state.step, directory=state.directory,
            format=state.format)
        self._spawn(self._commit_when_agreed, a, name=f"sidecar-commit-{a.step}")
    if a is None:
      return AgreeState(final_dir=state.final_dir, save=state.save, step=state.step,
                        host=self._host_id, standing=Standing.UNKNOWN)
    if a.plan.committer != self._host_id:
      return self._state_of(a)
    if state.host not in a.plan.hosts or state.host == self._host_id:
      raise errors.InvalidArgumentError(
          f"Agree: host {state.host} is not another host of step {a.step} "
          f"(hosts {list(a.plan.hosts)})")
    self._heard(a, state)
    with a.cond:
      if a.decision is not None:
        return a.decision
      written = tuple(h for h, p in a.states.items() if p.standing is Standing.WRITTEN)
    return AgreeState(final_dir=a.final_dir, save=a.plan.save, step=a.step,
                      host=self._host_id, standing=Standing.TAKEN_OVER, written=written)

  def await_commit(self, tmp_dir: str, step: int, owner: str, timeout: float) -> str:
    """A trainer's ``Commit`` of a step taken over here (``taken_over``): waits for the
    sidecars' decision; returns the committed directory, or raises why it was abandoned."""
    with self._lock:  # the newest of the step's saves (an older one may be kept, ended)
      a = max((a for a in self._saves.values()
               if a.tmp_dir == tmp_dir and a.step == step and owner in a.owners),
              key=lambda a: a.created, default=None)
    if a is None or a.plan.committer != self._host_id:
      raise errors.PermissionDeniedError(
          f"commit: tmp_dir {tmp_dir!r:.200} is not a step {step} this session staged and "
          f"host {self._host_id} commits for the sidecars (taken over); commit a step "
          "staged with no plan with its shards' records")
    with a.cond:
      if not a.cond.wait_for(lambda: a.decision is not None, timeout):
        raise errors.DeadlineExceededError(
            f"commit: step {step} is still being written or agreed on after {timeout:g} s")
      decision = a.decision
    assert decision is not None
    if decision.standing is Standing.COMMITTED:
      return decision.committed
    assert decision.error is not None
    raise decision.error

  def abort(self, final_dir: str) -> None:
    """The trainers abort the save of ``final_dir``: a save taken over here and not
    decided is abandoned (on the committer) or let go of (elsewhere)."""
    with self._lock:
      pending = [a for a in self._saves.values()
                 if a.final_dir == final_dir and a.decision is None]
    for a in pending:
      with a.cond:
        a.aborted = errors.ClosedError(f"its trainers aborted the save of step {a.step}")
        a.cond.notify_all()
      if a.plan.committer != self._host_id:
        self._decide(a, Standing.ABANDONED, error=a.aborted)

  def forget_decided(self) -> None:
    """Forgets the saves decided long ago (the reaper's)."""
    with self._lock:
      self._prune()

  # ---- states and calls --------------------------------------------------

  def _state_of(self, a: Agreement, *, records: bool = True, announce: bool = False
                ) -> AgreeState:
    """This host's state of ``a``: its decision, else its own part's."""
    with a.cond:
      if a.decision is not None:
        return a.decision
      own = a.own
    error = None
    written: tuple[ShardRecord, ...] = ()
    standing = own.view().agree if own is not None else Standing.UNKNOWN
    if standing is Standing.FAILED:
      assert own is not None and own.error is not None
      error = write_lib.write_failure(self._host_id, a.step, a.final_dir, own.error,
                                      tmp_dir=own.tmp_dir)
    elif standing is Standing.WRITTEN and records:
      assert own is not None
      written = tuple(own.written_records)
    return AgreeState(final_dir=a.final_dir, save=a.plan.save, step=a.step,
                      host=self._host_id, standing=standing, records=written, error=error,
                      plan=a.plan if announce else None, directory=a.directory,
                      format=a.format)

  def _tell(self, host: int, state: AgreeState) -> AgreeState:
    """``state`` to ``host``'s sidecar; its answer (asked again while it is busy)."""
    target = self._hosts.target(host, own=self._host_id)
    deadline = time.monotonic() + CALL_S
    while True:
      try:
        return self._links.agree(target, state, timeout=CALL_S)
      except errors.BusyError:
        if time.monotonic() + 0.05 > deadline or self._closed.wait(0.05):
          raise


class AgreeLinks:
  """One link per other sidecar for the agreements' calls (``links.ReplicaLink``, with
  the peer token; mapping no memory, unlike a replica link), kept from call to call; a
  link that fails is closed, the next call makes a new one. ``close()`` closes them."""

  def __init__(self, *, token: str | None, replica_token: str | None,
               credentials: grpc.ChannelCredentials | None):
    self._token, self._replica_token, self._credentials = token, replica_token, credentials
    self._links: dict[int, links_lib.ReplicaLink] = {}
    self._lock = threading.Lock()
    self._closed = False

  def agree(self, receiver: ReplicaTarget, state: AgreeState, *, timeout: float
            ) -> AgreeState:
    """``state`` told to ``receiver``'s sidecar (``ReplicaLink.agree``); its answer."""
    with self._lock:
      link = self._links.get(receiver.host_id)
    if link is None or link.receiver != receiver:
      link = links_lib.ReplicaLink(receiver, token=self._token,
                                   replica_token=self._replica_token,
                                   timeout=min(timeout, 30.0), shared_memory=False,
                                   credentials=self._credentials)
      with self._lock:
        old = None if self._closed else self._links.get(receiver.host_id)
        if not self._closed:
          self._links[receiver.host_id] = link
      if old is not None:
        old.close()
      if self._closed:
        link.close()
        raise errors.ClosedError("this sidecar is stopping")
    try:
      return link.agree(state, timeout=timeout)
    except (errors.HostLostError, errors.SessionLostError):
      with self._lock:
        if self._links.get(receiver.host_id) is link:
          del self._links[receiver.host_id]
      link.close()
      raise

  def close(self) -> None:
    with self._lock:
      self._closed = True
      links, self._links = list(self._links.values()), {}
    for link in links:
      link.close()


def _plan_of(own: step_lib.Step) -> CommitPlan:
  """The plan of a step whole here: every writer's names the same save; the data position
  is the lead's (the process that began it)."""
  plans = own.plans
  first = plans[0]
  if len(plans) != own.writers or any(not first.same_save(p) for p in plans):
    raise errors.InvalidArgumentError(
        f"step {own.step}: the {own.writers} trainer processes staging it here sent "
        f"{len(plans)} plans, not all of one save: every process sends its last part "
        "with the same plan")
  lead = next((p for p in plans if p.lead), first)
  return lead


def _refused(a: Agreement) -> errors.SidecarError:
  """Why this host may not take ``a`` over: its committer's answer."""
  d = a.decision
  if d is not None and d.standing is Standing.UNKNOWN:
    why = "knows no such save (never begun there, or its sidecar restarted since)"
  else:
    why = "abandoned this save before this host's part was whole" + (
        f" ({d.error})" if d is not None and d.error else "")
  return errors.ClosedError(
      f"step {a.step}: its committer, host {a.plan.committer}, {why}; save the step again")


def _with_text(e: errors.SidecarError, text: str) -> errors.SidecarError:
  """An error of ``e``'s kind saying ``text``."""
  if isinstance(e, errors.HostLostError):
    return errors.HostLostError(text, host_id=e.host_id)
  try:
    return type(e)(text)
  except TypeError:  # a kind with more to say than its text (RemoteError)
    return errors.InvalidArgumentError(text)
