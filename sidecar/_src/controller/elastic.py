"""``sidecar.elastic.retry``: when a host is lost, train on, on the hosts that remain.

Runs in the controller (single-controller JAX: one process owns every device), and
knows no framework (``sidecar.elastic.devices``, the JAX devices of some hosts, is
``jax/elastic.py``'s). The training function ``train(hosts)`` builds its mesh from
those hosts' devices, restores the latest step (with its data position) and opens its
feed; when a host
is lost mid-way (its sidecar dies or stops answering), the controller drops it,
cancels the feeds and streams in flight, and calls ``train`` again with the hosts
that are left. Every phase is an :class:`Event`, logged at INFO and kept. A checkpointer
follows the controller's live hosts, so one made before the loss saves on the hosts left
(a save begun before the loss that fails is logged, not raised into the next attempt).
Each attempt, until its first completed step, is a phase of the sidecars' stall rule
(``ctl.phase(stall.ATTEMPT, budget_s=stall.ATTEMPT_BUDGET_S, until_step=True)``): its
restore and its first step's recompile on the new mesh are never taken for a hang.

Example::

  ckpt = ctl.checkpointer(directory, max_to_keep=2)  # it follows the live hosts

  @sidecar.elastic.retry(ctl, min_hosts=2)
  def train(hosts):
    mesh = Mesh(np.array(sidecar.elastic.devices(ctl, hosts)), ("data",))
    with sidecar.elastic.phase("restore"):
      state = ckpt.restore(target=abstract(mesh)) if ckpt.latest_step() is not None else init()
    with ctl.feed("images", global_batch_size=64, sharding=rows(mesh),
                  state=ckpt.data_state() if ckpt.latest_step() is not None else None) as feed:
      ...

  train()           # runs on every live host; returns what train returned
  train.events      # what happened, with the time of each phase

With ``grow=True``, a lost host whose sidecar comes back (a new one at the same
address) rejoins the controller; the next ``ckpt.save`` inside ``train`` waits for its
step to be durable, then raises :class:`Regrow`, and ``train`` is called again on every
live host (its restore takes that step from the RAM tiers).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sidecar._src.core import deprecation, errors, stall

log = logging.getLogger(__name__)
_current: contextvars.ContextVar[Retry | None] = contextvars.ContextVar(
    "sidecar_elastic_retry", default=None)
# A failure can reach the trainer before the watch has seen the host go: how long to
# wait for the watch before calling the failure the trainer's own.
_GRACE_S = 3.0


class Regrow(Exception):
  """Raised by a save under ``retry(grow=True)`` once lost hosts are back; the step it
  saved is durable, and ``retry`` calls ``train`` again on every live host. Let it
  pass (an ``except Exception`` around the save must re-raise it)."""

  def __init__(self, step: int, back: Sequence[int]):
    super().__init__(f"hosts {sorted(back)} are back: training goes on from step {step} on "
                     "every live host")
    self.step, self.back = step, sorted(back)


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
  """One thing that happened: ``kind`` is "start", "host_lost", "host_back", "retry",
  "grow", "phase", "done", or "gave_up"; ``seconds`` is the phase's duration where one
  applies."""
  kind: str
  at: float  # time.monotonic()
  hosts: tuple[int, ...]  # the live hosts then
  detail: str = ""
  seconds: float | None = None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
  """Times a phase of the training function (restore, reopen the feed, first step...)
  as an Event of the running :func:`retry`; outside one, does nothing."""
  retry = _current.get()
  t0 = time.monotonic()
  try:
    yield
  finally:
    if retry is not None:
      retry.note("phase", detail=name, seconds=time.monotonic() - t0)


def at_save(handle: Any) -> None:
  """Called by ``Checkpointer.save`` with its handle: under ``retry(grow=True)``, once
  a lost host is back, waits for the step to be durable and raises :class:`Regrow`."""
  retry = _current.get()
  back = retry.returned() if retry is not None else []
  if back:
    handle.durable.result()  # the step the next attempt restores
    raise Regrow(handle.step, back)


def retry(ctl: Any, *, min_hosts: int = 1, max_restarts: int | None = None,
          interval: float | None = None, lost_after: float | None = None,
          grow: bool = False) -> Callable[[Callable[..., Any]], Retry]:
  """Decorates ``train(hosts, ...)`` so that calling it trains on, through host losses.

  Args:
    ctl: the Controller of every host.
    min_hosts: fewer live hosts than this: raise HostLostError naming the lost hosts.
    max_restarts: how many times to call ``train`` again at most (None: no limit).
    interval, lost_after: the health watch's poll interval and how long a host may stay
      silent before it is lost (``Controller.watch``).
    grow: when a lost host's sidecar comes back, train on it again from the next save
      (off by default: a lost host stays lost).
  """
  if not isinstance(min_hosts, int) or min_hosts < 1:
    raise errors.InvalidArgumentError(f"min_hosts must be an int >= 1, got {min_hosts!r}")
  if max_restarts is not None and (not isinstance(max_restarts, int) or max_restarts < 0):
    raise errors.InvalidArgumentError(
        f"max_restarts must be None or an int >= 0, got {max_restarts!r}")
  watch = {k: v for k, v in (("interval", interval), ("lost_after", lost_after))
           if v is not None}
  if ctl.multiprocess and grow:
    raise errors.InvalidArgumentError(
        "grow=True needs one controller process owning every device; under N processes "
        "`sidecar launch --elastic` restarts the job instead")
  return lambda fn: Retry(fn, ctl, min_hosts=min_hosts, max_restarts=max_restarts,
                          watch=dict(watch, rejoin=grow))


class Retry:
  """A training function that survives host losses; made by :func:`retry`."""

  def __init__(self, fn: Callable[..., Any], ctl: Any, *, min_hosts: int,
               max_restarts: int | None, watch: dict[str, Any]):
    functools.update_wrapper(self, fn)
    self._fn, self._ctl = fn, ctl
    self._min_hosts, self._max_restarts, self._watch = min_hosts, max_restarts, watch
    self._grow = bool(watch.get("rejoin"))
    self._hosts: list[int] = []  # the running attempt's
    self._events: list[Event] = []
    self._lock = threading.Lock()
    self._lost = threading.Condition(self._lock)
    self._listening = False

  @property
  def events(self) -> list[Event]:
    """Everything that happened so far, in order."""
    with self._lock:
      return list(self._events)

  def note(self, kind: str, *, detail: str = "", seconds: float | None = None) -> Event:
    """Adds an :class:`Event` of ``kind`` to :attr:`events` (and logs it)."""
    hosts = tuple(h.host_id for h in self._ctl.hosts)
    event = Event(kind, time.monotonic(), hosts, detail, seconds)
    with self._lock:
      self._events.append(event)
      self._lost.notify_all()
    timing = f" in {seconds:.3f} s" if seconds is not None else ""
    log.info("elastic: %s%s%s; live hosts %s", kind, f" ({detail})" if detail else "",
             timing, list(hosts))
    return event

  def record(self, kind: str, *, detail: str = "", seconds: float | None = None) -> Event:
    """Deprecated: :meth:`note` (a record is a shard's, ARCHITECTURE.md's glossary)."""
    deprecation.warn("sidecar.elastic.Retry.record", deprecation.Moved("Retry.note"))
    return self.note(kind, detail=detail, seconds=seconds)

  def _on_lost(self, host_id: int, reason: str) -> None:
    self.note("host_lost", detail=f"host {host_id}: {reason}")

  def _on_back(self, host_id: int) -> None:
    self.note("host_back", detail=f"host {host_id}")

  def returned(self) -> list[int]:
    """With ``grow``: live hosts the running attempt does not train on."""
    if not self._grow or not self._hosts:
      return []
    return sorted({h.host_id for h in self._ctl.hosts} - set(self._hosts))

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if not self._listening:
      self._ctl.on_host_lost(self._on_lost)
      self._ctl.on_host_back(self._on_back)
      self._listening = True
    self._ctl.watch(**self._watch)
    restarts = 0
    token = _current.set(self)
    try:
      while True:
        hosts = [h.host_id for h in self._ctl.hosts]
        if len(hosts) < self._min_hosts:
          self.note("gave_up", detail=f"{len(hosts)} live hosts < min_hosts")
          raise errors.HostLostError(
              f"{len(hosts)} live hosts {hosts} is fewer than min_hosts={self._min_hosts}; "
              f"lost: " + "; ".join(f"host {h} ({why})" for h, why in
                                    sorted(self._ctl.lost_hosts.items())),
              host_id=min(self._ctl.lost_hosts, default=None))
        lost_before = set(self._ctl.lost_hosts)
        self._hosts = hosts
        self.note("start", detail=f"attempt {restarts + 1}")
        t0 = time.monotonic()
        try:
          # Its restore and recompile come before its first step: not a stall (core/stall.py).
          with self._ctl.phase(stall.ATTEMPT, budget_s=stall.ATTEMPT_BUDGET_S,
                               until_step=True):
            out = self._fn(hosts, *args, **kwargs)
        except Regrow as e:
          self.note("grow", detail=str(e), seconds=time.monotonic() - t0)
          continue
        except Exception as e:
          if not self._host_was_lost(lost_before) or (
              self._max_restarts is not None and restarts >= self._max_restarts):
            raise
          restarts += 1
          self.note("retry", detail=f"{type(e).__name__}: {str(e)[:200]}",
                      seconds=time.monotonic() - t0)
          continue
        self.note("done", seconds=time.monotonic() - t0)
        return out
    finally:
      self._hosts = []
      _current.reset(token)

  def _host_was_lost(self, before: set[int]) -> bool:
    """Whether a host was lost since ``before``, waiting a little for the watch to see it."""
    deadline = time.monotonic() + _GRACE_S
    with self._lost:
      while not set(self._ctl.lost_hosts) - before:
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._lost.wait(left)
    return True
