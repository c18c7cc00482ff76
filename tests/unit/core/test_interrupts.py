"""Ctrl-C deferred to a block's end, and a wait that got what it waited for keeps it."""

import concurrent.futures
import contextlib
import os
import signal
import threading
import time

import pytest

from sidecar._src.core import errors, interrupts
from tests.conftest import eventually

pytestmark = pytest.mark.unit


def test_deferred_raises_at_its_end_and_restores_the_handler():
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  with pytest.raises(KeyboardInterrupt), interrupts.deferred():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # noted, not raised: we are still here
    assert interrupts.requested()
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_in_a_block_an_error_leaves_is_raised_not_lost():
  # Before: the error went on and the Ctrl-C was dropped; a caller that handled the error
  # (a retry) trained on, Ctrl-C forgotten.
  with pytest.raises(KeyboardInterrupt) as raised, interrupts.deferred():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    raise errors.BusyError("a sidecar busy")
  assert isinstance(raised.value.__context__, errors.BusyError)
  assert not interrupts.requested()


def test_another_threads_check_leaves_the_main_threads_ctrl_c_to_it():
  # A caller thread's wait (a call_async over a socket) polls check() too: it must not
  # take the KeyboardInterrupt the main thread's deferred block is to raise.
  raised = []

  def other():
    try:
      interrupts.check()
    except KeyboardInterrupt:
      raised.append(True)

  with pytest.raises(KeyboardInterrupt), interrupts.deferred():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert not raised and interrupts.requested()


def test_a_call_slot_that_came_is_kept_though_ctrl_c_came_too():
  """A wait that got its slot returns it though Ctrl-C is pending; none is ever lost."""
  from sidecar._src.controller.connection import CallWindow
  came = threading.Event()
  came.set()
  with pytest.raises(KeyboardInterrupt), interrupts.deferred():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert interrupts.wait_event(came, 1.0)  # what came is kept; Ctrl-C at the block's end
  window = CallWindow(1, name="h")
  assert window.enter(0.0)
  # Ctrl-C ends the wait, or comes at the block's end if the slot came first.
  with contextlib.suppress(KeyboardInterrupt), interrupts.deferred():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    threading.Timer(0.05, window.exit).start()  # the slot comes about as Ctrl-C is seen
    if window.enter(5.0):
      window.exit()
  def free() -> bool:  # the one slot can be taken (and is given back)
    taken = window.enter(0.0)
    if taken:
      window.exit()
    return taken
  assert eventually(free)
  ready, seen = threading.Event(), []
  worker = threading.Thread(target=lambda: seen.append(interrupts.wait_event(ready, 0.3)))
  with pytest.raises(KeyboardInterrupt), interrupts.deferred():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    worker.start()
    worker.join()  # another thread's wait leaves the main thread's Ctrl-C to it
  assert seen == [False]


def test_a_future_that_fails_with_a_timeout_error_raises_it_and_does_not_poll_forever():
  """DeadlineExceededError is a TimeoutError: it was taken for the poll's own timeout."""
  assert threading.current_thread() is threading.main_thread()
  future = concurrent.futures.Future()
  future.set_exception(errors.DeadlineExceededError("Read on host 0 timed out"))
  with interrupts.deferred(), pytest.raises(errors.DeadlineExceededError, match="timed out"):
    interrupts.wait(future, timeout=5)
  with interrupts.deferred(), pytest.raises(concurrent.futures.TimeoutError):
    interrupts.wait(concurrent.futures.Future(), timeout=0.2)  # its own timeout still is
  with interrupts.deferred():
    interrupts.wait_done(future, timeout=5)  # done: whatever its outcome, no timeout
