"""Ctrl-C (KeyboardInterrupt) taken only where it leaves nothing half-done.

A KeyboardInterrupt is raised in the main thread between any two bytecodes. Raised
just after a ``threading.Condition`` was entered (Python code: gRPC's channel state
and every ``concurrent.futures.Future`` use one), it leaves that lock held for good,
and the gRPC threads that deliver every later result on the channel wait for it
forever (found with py-spy: an interrupted ``ckpt.save`` hung its own abort). Raised
just after a stream's item was read from its socket, it loses that item. So the
controller's calls and a stream's or feed's ``next()`` run with SIGINT *deferred*: the
handler only notes it, the long waits inside poll :func:`check` and clean up, and the
KeyboardInterrupt is raised once the call is out of gRPC's and the futures' locks, or
no item is half taken.

Only the main thread gets SIGINT, and only Python's own handler is deferred: a
program that installed its own handler keeps it. Other threads' waits never take the
main thread's Ctrl-C (:func:`check` is the main thread's alone).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal.signal without its enum conversions
import concurrent.futures
import functools
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# How often a deferred wait looks whether Ctrl-C was pressed.
POLL_S = 0.05

_depth = 0  # nesting of deferred() in the main thread
_pending = False  # SIGINT came while deferred
_previous: Any = None
# _signal's functions are signal.signal's without the enum conversions, which raise and
# catch a ValueError for every handler that is a function: 50-70 us a call at a load of 10,
# a tenth of a no-op ctl.call.
_SIGINT = int(signal.SIGINT)


def _note(signum: int, frame: Any) -> None:
  global _pending
  _pending = True


class deferred:
  """A block in which SIGINT is noted instead of raised; raised on leaving it.

  Example::

    with interrupts.deferred():
      future = rpc.future(request)
      result = interrupts.wait(future)   # KeyboardInterrupt here, at a safe point
  """

  __slots__ = ("_active",)

  def __enter__(self) -> deferred:
    global _depth, _previous, _pending
    self._active = False
    if threading.current_thread() is not threading.main_thread():
      return self
    if _depth == 0:
      if _signal.getsignal(_SIGINT) is not signal.default_int_handler:
        return self  # someone else's handler, or SIGINT ignored: not ours to change
      _pending = False
      _previous = _signal.signal(_SIGINT, _note)
    _depth += 1
    self._active = True
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    global _depth, _pending
    if not self._active:
      return
    _depth -= 1
    if _depth:
      return
    _signal.signal(_SIGINT, _previous)
    if _pending:
      _pending = False
      # Ctrl-C wins over an error leaving the block: a caller that handles the error (a
      # retry, a closed stream) would otherwise never see the Ctrl-C, and train on.
      if exc_type is None or not issubclass(exc_type, KeyboardInterrupt):
        raise KeyboardInterrupt


class Kept:
  """What ``next()`` took, kept across a Ctrl-C: :meth:`take` makes the value in a
  deferred block, and where Ctrl-C came meanwhile (after an item was read, say) the
  KeyboardInterrupt leaves the value here, for the next :meth:`take` to return first.

  Example::

    def __next__(self):
      return self._kept.take(self._next)   # _next waits with check() (no item read yet)
  """

  __slots__ = ("_value", "_held")

  def __init__(self) -> None:
    self._value: Any = None
    self._held = False

  def take(self, make: Callable[[], T]) -> T:
    if not self._held:
      with deferred():
        self._value, self._held = make(), True
    value, self._value, self._held = self._value, None, False
    return value

  @property
  def held(self) -> bool:
    """Whether a value made before a Ctrl-C waits for the next :meth:`take`."""
    return self._held

  def clear(self) -> None:
    """Drops a kept value (its arena views with it)."""
    self._value, self._held = None, False


def deferring(fn: F) -> F:
  """Runs ``fn`` in a :class:`deferred` block (a decorator)."""
  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    with deferred():
      return fn(*args, **kwargs)
  return wrapper  # type: ignore[return-value]


def requested() -> bool:
  """Whether Ctrl-C was pressed inside the current deferred block."""
  return _pending


def check() -> None:
  """Raises KeyboardInterrupt now if Ctrl-C was pressed inside a deferred block, in the
  main thread (another thread's wait, a caller thread's say, leaves it to the main one)."""
  global _pending
  if _pending and threading.current_thread() is threading.main_thread():
    _pending = False
    raise KeyboardInterrupt


def wait(future: concurrent.futures.Future | Any, timeout: float | None = None) -> Any:
  """``future.result(timeout)``, raising KeyboardInterrupt (at once) on Ctrl-C.

  Works for ``concurrent.futures.Future`` and gRPC futures alike. Outside a
  deferred block it is a plain ``result()``.
  """
  if _depth == 0 or threading.current_thread() is not threading.main_thread():
    return future.result(timeout)
  left = timeout
  while True:
    step = POLL_S if left is None else min(POLL_S, left)
    try:
      return future.result(step)
    except (concurrent.futures.TimeoutError, TimeoutError):
      if future.done():  # the future's own error (DeadlineExceededError is a TimeoutError)
        raise
    except Exception as e:  # gRPC futures raise grpc.FutureTimeoutError
      if type(e).__name__ != "FutureTimeoutError":
        raise
    check()
    if left is not None:
      left -= step
      if left <= 0:
        raise concurrent.futures.TimeoutError()


def wait_event(event: threading.Event, timeout: float) -> bool:
  """``event.wait(timeout)``, raising KeyboardInterrupt (at once) on Ctrl-C, as :func:`wait`.

  Never raises once the event is set: a wait that got what it waited for returns True.
  """
  if _depth == 0 or threading.current_thread() is not threading.main_thread():
    return event.wait(timeout)
  deadline = time.monotonic() + timeout
  while True:
    if event.wait(min(POLL_S, max(deadline - time.monotonic(), 0.0))):
      return True
    check()
    if time.monotonic() >= deadline:
      return False


def wait_done(future: concurrent.futures.Future, timeout: float | None = None) -> None:
  """Waits until ``future`` is done, whatever its outcome, as :func:`wait` does; its
  outcome is not read (a save's ``Durable`` stays untold). Raises
  ``concurrent.futures.TimeoutError`` if it is not done within ``timeout``."""
  deferred = _depth > 0 and threading.current_thread() is threading.main_thread()
  deadline = None if timeout is None else time.monotonic() + timeout
  while True:
    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    step = left if not deferred else POLL_S if left is None else min(POLL_S, left)
    if concurrent.futures.wait([future], step).done:
      return
    if deferred:
      check()
    if deadline is not None and time.monotonic() >= deadline:
      raise concurrent.futures.TimeoutError()
