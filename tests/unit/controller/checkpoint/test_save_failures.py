"""A checkpointer's saves that failed in the background (controller/checkpoint/save_failures.py)."""

import logging

import pytest

from sidecar._src.controller.checkpoint import save_failures, save_run

pytestmark = pytest.mark.unit


def _failed(error: BaseException, caplog) -> list[str]:
  failures = save_failures.SaveFailures("/ckpt/run", in_a_row=3, latest=lambda: 10)
  handle = save_run.SaveHandle(20, save_run.Durable(), save_run.Durable())
  failures.begun(handle)
  with caplog.at_level(logging.WARNING, logger=save_failures.__name__):
    handle.durable.set_exception(error)
  return [r.getMessage() for r in caplog.records]


def test_a_failed_save_is_said_at_once(caplog):
  said = _failed(OSError(28, "No space left on device"), caplog)
  assert len(said) == 1 and said[0].startswith(
      "the save of step 20 into /ckpt/run failed in the background: OSError: "), said


def test_ctrl_c_that_meets_a_save_is_no_failed_save_training_goes_on_after(caplog):
  """The LM example's Ctrl-C test, under CI's load: the SIGINT's KeyboardInterrupt reached a
  save on its way (its durable failed with it), and the trainer printed "the save of step 20
  ... failed in the background: KeyboardInterrupt: . Training goes on" above its one line
  saying it stopped."""
  assert _failed(KeyboardInterrupt(), caplog) == []
  assert _failed(SystemExit(1), caplog) == []


def test_a_failure_outside_exception_is_said_too(caplog):
  """torch DCP's CheckpointException derives from BaseException, not Exception: a failed
  DCP save is said like any other."""
  class CheckpointException(BaseException):
    pass

  said = _failed(CheckpointException("write failed"), caplog)
  assert len(said) == 1 and "failed in the background: CheckpointException: " in said[0]
