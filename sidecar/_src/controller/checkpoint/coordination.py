"""How one save's trainer processes coordinate it: :class:`Coordination`.

Through their key-value store (:class:`KeyValue`: process 0 begins, every process stages its
own hosts and says at the commit whether it succeeded, and the sidecars commit), or as DCP
does it (:class:`Coordinator`: DCP's own gather and scatter carry the plan and the results,
and its coordinator rank alone begins, waits for every host and commits). A step as its
beginning process began it is a :class:`Begun`, the same in every process. Before a step,
the processes check they save the same step and share whether a save is in flight
(:func:`same_step_any_busy`, which the Checkpointer calls). The save step itself, which
calls them between its values, is ``save_run.SaveRun``.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Callable, Sequence

from sidecar._src.controller.checkpoint.save_protocol import LONG_S
from sidecar._src.controller.peers import Peers, sync_timeout
from sidecar._src.core import errors
from sidecar._src.wire import protocol


@dataclasses.dataclass(frozen=True, slots=True)
class Begun:
  """A step as its beginning process began it: its tmp directory (Begin's answer; "" where
  another commits the step), the host it was begun on (which commits it) and the save's
  id (unique: the sidecars never mix two saves of a step); the same in every process.
  ``with_stage``: not begun yet, its first Stage begins it (``tmp`` where that makes it;
  the other processes are told once it has: ``Coordination.announce``)."""
  tmp: str
  committer: int | None = None
  save: str = ""
  with_stage: bool = False


class Coordination(abc.ABC):
  """How one save's trainer processes coordinate: who begins the step, who commits it."""
  lead = True  # whether this process began the step (its data position is the manifest's)
  alone = True  # whether this process is the only one (it stages into every host)
  takes_over = False  # whether the sidecars commit its steps themselves (a CommitPlan)

  @abc.abstractmethod
  def begin(self, step: int, begin: Callable[[], Begun]) -> Begun:
    """The step as begun: the process that begins runs ``begin`` (its sidecar's answer)
    and the others are told it."""

  @abc.abstractmethod
  def commit(self, step: int, error: BaseException | None,
             commit: Callable[[Sequence[int]], object], abort: Callable[[], None]) -> None:
    """Commits the step once, or aborts it everywhere; raises in every process where the
    save failed in any. ``error``: this process's failure so far (None: its hosts are
    prepared). ``commit(others)``: the commit, on the process that commits, given the
    hosts other processes staged into; ``abort``: every host drops the step."""

  def announce(self, begun: Begun, error: BaseException | None) -> None:  # noqa: B027
    """Tells the other processes the step a first Stage began (``begun.with_stage``), or
    why it could not begin it; nothing where no other process waits for it."""


class KeyValue(Coordination):
  """The processes coordinate through their key-value store (``controller/peers.Peers``)
  under ``key``: process 0 begins, and aborts or waits for the commit; every process
  stages its own hosts, and the sidecars commit the step once it is whole on all."""
  takes_over = True

  def __init__(self, peers: Peers, key: str, local: Sequence[int]):
    self._peers, self._key, self._local = peers, key, list(local)
    self._lead = self.lead = peers.index == 0
    self.alone = peers.count == 1

  def begin(self, step: int, begin: Callable[[], Begun]) -> Begun:
    """Process 0's sidecar makes the tmp directory; the others wait until it has."""
    if not self._lead:
      begun = json.loads(self._peers.read(f"{self._key}/begun", 0, timeout=sync_timeout()))
      if "error" in begun:
        raise errors.InvalidArgumentError(
            f"process 0 could not begin step {step}: {begun['error']}")
      return Begun(begun["tmp"], begun.get("committer"), begun.get("save", ""))
    try:
      here = begin()
    except BaseException as e:
      self.announce(Begun(""), e)
      raise
    if not here.with_stage:  # else once its first Stage began it
      self.announce(here, None)
    return here

  def announce(self, begun: Begun, error: BaseException | None) -> None:
    """Process 0 tells the others the step it began (its first Stage's, once answered),
    or why it could not."""
    if self._lead:
      self._peers.publish(f"{self._key}/begun", json.dumps(
          {"error": describe(error)} if error is not None
          else dataclasses.asdict(dataclasses.replace(begun, with_stage=False))))

  def commit(self, step: int, error: BaseException | None,
             commit: Callable[[Sequence[int]], object], abort: Callable[[], None]) -> None:
    """Process 0 gathers every process's outcome, then commits once (or waits for the
    sidecars' commit) or aborts.

    Every process gets here once per save, failed or not, so nobody waits for one that
    gave up. The others tell process 0 only which hosts they staged into: it asks those
    hosts for their written records itself, so no record crosses between the processes.
    """
    key = self._key
    mine = json.dumps({"error": protocol.error_dict(error)} if error is not None
                      else {"ok": self._local})
    if not self._lead:
      self._peers.publish(f"{key}/prepared", mine)
      failed = self._peers.read(f"{key}/outcome", 0, timeout=LONG_S)
      if error is not None:
        raise error
      if failed:
        raise _gathered(json.loads(failed), 0, f"the save of step {step} failed")
      return
    try:
      gathered = [json.loads(v) for v in self._peers.all_gather(
          f"{key}/prepared", mine, timeout=LONG_S)]
      failures = [(p, g["error"]) for p, g in enumerate(gathered) if "error" in g]
      if error is not None:
        raise error
      if failures:  # the first as it was raised (its kind, its host); the others noted
        p, first = failures[0]
        raise _gathered(first, p, f"the save of step {step} failed in process {p}"
                        + "".join(f"; also in process {q}: {d.get('type')}: "
                                  f"{str(d.get('message'))[:500]}" for q, d in failures[1:]))
      # A host that several processes share: asked once.
      commit(sorted({int(h) for g in gathered for h in g["ok"]} - set(self._local)))
    except BaseException as e:
      abort()  # before anyone fails: a retry must not race
      self._peers.publish(f"{key}/outcome", json.dumps(protocol.error_dict(e)))
      raise
    self._peers.publish(f"{key}/outcome", "")


class Coordinator(Coordination):
  """DCP's: its collectives carry the plan (with Begin's answer) to every rank and their
  write results back, so its coordinator rank alone begins and commits, over every
  host (the other ranks only stage). DCP's metadata, which its commit writes, is made
  only once every rank wrote: its trainers commit the step."""

  def begin(self, step: int, begin: Callable[[], Begun]) -> Begun:
    return begin()

  def commit(self, step: int, error: BaseException | None,
             commit: Callable[[Sequence[int]], object], abort: Callable[[], None]) -> None:
    try:
      if error is not None:
        raise error
      commit(())
    except BaseException:
      abort()
      raise


def _gathered(d: dict, process: int, note: str) -> errors.SidecarError:
  """The error another process gathered at the commit (``protocol.error_dict``): its
  kind and host as raised there, with ``note`` saying where the save failed."""
  error = protocol.error_from_dict(d, host=f"trainer process {process}")
  error.add_note(note)
  return error


def same_step_any_busy(peers: Peers, key: str, step: int, busy: bool, *, what: str) -> bool:
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


def describe(e: BaseException | None) -> str:
  """An error as one line of text for the other processes (empty: none)."""
  return f"{type(e).__name__}: {e}"[:2000] if e is not None else ""
