"""The trainer's side of the goodput ledger: a :class:`LedgerClient` the Controller owns.

The trainer writes no code for it: the Controller of process 0 makes one, its feeds
report each batch taken (and how long ``next()`` blocked), its checkpointers each
``save()`` and ``restore()`` (and how long they blocked). The first checkpointer opened
binds the ledger to its directory: from then on the events go to this host's sidecar
over the worker socket (``arena/worker.Worker.send_ledger``), which appends them to the
ledger's file there and notes the process's death when its session ends without the
``finish`` that ``Controller.close()`` sends (``server/goodput/ledgers.py``; the schema:
``core/goodput.py``, the accounting: ``core/accounting.py``).

Per batch the ledger client adds to a float and an int and compares a time stamp the feed
already took: the counters travel with the events that happen anyway (a save, a restore)
and at most every :data:`MARK_EVERY_S` in a mark, a frame written to the socket without
waiting for an answer, never while another thread holds the socket.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from sidecar._src.core import env as env_lib, goodput as goodput_lib

log = logging.getLogger(__name__)

MARK_EVERY_S = 5.0  # at most this often a mark of the counters goes to the sidecar
MAX_PENDING = 64  # events kept while none can be sent (before the ledger is bound)
MAX_EVENTS = 256  # events in one message to the sidecar (it refuses more)
OP = "goodput"  # the worker socket's op


class LedgerTransport(Protocol):
  """Where the ledger client's messages go: a Worker's socket (``Worker.send_ledger``).

  A complete one, for tests::

    class Sent:
      def __init__(self):
        self.messages = []

      def send_ledger(self, message, *, reply, wait):
        self.messages.append(message)
        return True
  """

  def send_ledger(self, message: dict[str, Any], *, reply: bool, wait: bool) -> bool:
    """Sends ``message``; with ``reply`` waits for the sidecar's answer (raising its
    error), else returns whether it went (False: the socket was busy, and ``wait`` was
    False, or the sidecar is gone)."""
    ...


def process_start(pid: int | str = "self") -> float:
  """When process ``pid`` (default: this one) began (Unix seconds), as the kernel says: its
  ``starttime`` in ``/proc/PID/stat`` (clock ticks after boot, on the boot-time clock), so
  it covers the interpreter's start, the imports and JAX's init. Where there is no such
  ``/proc`` entry: now.

  Its age on the boot-time clock is taken from now: ``/proc/stat``'s ``btime`` would do
  too, but it is whole seconds. For this process, ``$SIDECAR_STARTED`` wins where set: a
  standby process (``sidecar launch --standby``) was told to run then, its imports done
  before the restart.
  """
  if pid == "self" and (told := env_lib.get(env_lib.STARTED)) is not None:
    try:
      return float(told)
    except ValueError:
      pass  # not ours to fail on: the kernel's time below
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22; the state is field 3
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
  except (OSError, ValueError, IndexError, AttributeError):
    return time.time()
  return time.time() - max(age, 0.0)


class LedgerClient:
  """One process life's counters and events; see the module docstring.

  Args:
    transport: where the events go once the ledger is bound (this host's Worker).
    start: when the process began (default: :func:`process_start`).
    clock: wall-clock seconds (event time stamps); ``counter``: the feed's and the
      checkpointer's stopwatch (``time.perf_counter``).
  """

  def __init__(self, transport: LedgerTransport, *, start: float | None = None,
               pid: int | None = None,
               clock: Callable[[], float] = time.time,
               counter: Callable[[], float] = time.perf_counter,
               mark_every: float = MARK_EVERY_S):
    self.start = process_start() if start is None else start
    self.pid = os.getpid() if pid is None else pid
    self.life = f"{self.pid}@{self.start:.3f}"
    self._clock, self._counter, self._every = clock, counter, mark_every
    self.batches = 0
    self.data_s = self.ckpt_s = self.restore_s = 0.0
    self.first_step: float | None = None
    self.directory: str | None = None
    self._link = transport
    self._transport: LedgerTransport | None = None  # the link, once bound
    self._pending: list[dict[str, Any]] = [self._event("start", start=self.start,
                                                       pid=self.pid).to_dict()]
    self._due = float("inf")  # the counter's value at which a mark goes (once bound)
    self.finished = False

  @classmethod
  def of_process(cls, index: int, transports: Iterable[LedgerTransport | None]
                 ) -> LedgerClient | None:
    """The job's ledger client: process ``index`` 0's, sending to the first of
    ``transports`` (the Workers of the sidecars it maps, None where none is mapped);
    None elsewhere (other processes, or no arena mapped here)."""
    if index != 0:
      return None
    transport = next((t for t in transports if t is not None), None)
    return None if transport is None else cls(transport)

  # ---- what the feed and the checkpointer report -------------------------------------

  def batch(self, blocked_s: float, now: float) -> None:
    """A batch was taken after ``next()`` blocked ``blocked_s``; ``now``: the counter's
    value when it returned. The per-step path: adds, and compares."""
    self.data_s += blocked_s
    self.batches += 1
    if self.batches == 2 and self.first_step is None:
      self._first_step()
    if now >= self._due:
      self._due = now + self._every
      self._emit(self._event("mark"), wait=False)

  def saved(self, step: int | None, blocked_s: float) -> None:
    """``save(step)`` returned after ``blocked_s`` (``step`` None: it skipped)."""
    if self.first_step is None:  # the first step's work is done once it is saved
      self._first_step(before=blocked_s)
    self.ckpt_s += blocked_s
    if step is not None:
      self._emit(self._event("save", step=step), wait=True)

  def checkpoint_wait(self, blocked_s: float) -> None:
    """The trainer waited ``blocked_s`` for saves to end (closing a checkpointer)."""
    self.ckpt_s += blocked_s

  def restored(self, step: int, blocked_s: float) -> None:
    """``restore(step)`` returned after ``blocked_s``."""
    self.restore_s += blocked_s
    self._emit(self._event("restore", step=step), wait=True)

  # ---- binding and ending ---------------------------------------------------------------

  def bind(self, directory: str) -> None:
    """Binds the ledger to the checkpoint ``directory`` (the first one only) and sends
    what was kept; a sidecar that refuses it is logged, and the ledger client stops sending."""
    if self.directory is not None or self.finished:
      return
    transport = self._link
    self.directory = directory
    events, self._pending = self._pending + [self._event("mark").to_dict()], []
    try:
      transport.send_ledger({"op": OP, "directory": directory, "events": events},
                            reply=True, wait=True)
    except Exception as e:  # noqa: BLE001 - the ledger never stops the training
      log.warning("goodput: the sidecar did not take the ledger of %s (%s: %s); this "
                  "process's time is not recorded", directory, type(e).__name__, e)
      return
    self._transport = transport
    self._due = self._counter() + self._every

  def finish(self) -> None:
    """The process ends cleanly (``Controller.close()``): its last event; idempotent."""
    if not self.finished:
      self.finished = True
      self._emit(self._event("finish"), wait=True)
      self._transport = None

  def abandon(self) -> None:
    """The process ends with an error: its counters go, and no finish (the sidecar
    writes its death when the session ends)."""
    if not self.finished:
      self.finished = True
      self._emit(self._event("mark"), wait=True)
      self._transport = None

  # ---- internals ------------------------------------------------------------------------

  def _first_step(self, before: float = 0.0) -> None:
    self.first_step = self._clock() - before
    event = self._event("first_step")
    self._emit(goodput_lib.Event("first_step", self.life, self.first_step, event.counters),
               wait=True)

  def _event(self, kind: str, **fields: Any) -> goodput_lib.Event:
    return goodput_lib.Event(kind, self.life, self._clock(), goodput_lib.Counters(
        self.batches, self.data_s, self.ckpt_s, self.restore_s), **fields)

  def _emit(self, event: goodput_lib.Event, *, wait: bool) -> None:
    """Sends ``event`` with those kept before it; keeps them where it cannot."""
    self._pending.append(event.to_dict())
    if self._transport is None:
      del self._pending[1:-MAX_PENDING]  # the start event stays
      return
    events, self._pending = self._pending[-MAX_EVENTS:], []
    try:
      sent = self._transport.send_ledger({"op": OP, "events": events}, reply=False, wait=wait)
    except Exception as e:  # noqa: BLE001 - the ledger never stops the training
      log.warning("goodput: sending to the sidecar failed (%s: %s); this process's time "
                  "is no longer recorded", type(e).__name__, e)
      self._transport = None
      return
    if not sent:  # busy: they go with the next
      self._pending = [e for e in events if e["kind"] != "mark"][-MAX_PENDING:]
