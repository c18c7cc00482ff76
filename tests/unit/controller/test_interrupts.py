"""Tier 1: interrupts.wait returns what a future ends with, inside a deferred block too."""

import concurrent.futures
import threading

import pytest

from sidecar._src.controller import interrupts
from sidecar._src.core import errors

pytestmark = pytest.mark.unit


def test_a_future_that_fails_with_a_timeout_error_raises_it_and_does_not_poll_forever():
  """DeadlineExceededError is a TimeoutError: it was taken for the poll's own timeout."""
  assert threading.current_thread() is threading.main_thread()
  future = concurrent.futures.Future()
  future.set_exception(errors.DeadlineExceededError("Read on host 0 timed out"))
  with interrupts.deferred(), pytest.raises(errors.DeadlineExceededError, match="timed out"):
    interrupts.wait(future, timeout=5)
  with interrupts.deferred(), pytest.raises(concurrent.futures.TimeoutError):
    interrupts.wait(concurrent.futures.Future(), timeout=0.2)  # its own timeout still is
