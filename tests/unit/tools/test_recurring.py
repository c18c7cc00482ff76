"""sidecar launch's rule for failures that recur (tools/recurring.py): the same failure twice
in a row, before a first step or at the same step, ends the job; any other is restarted.
Tier 1: the rule on what the watchdog would hand it (test_watchdog.py: that it does)."""

import pytest

from sidecar._src.tools import recurring

pytestmark = pytest.mark.unit

MISSING = "FileNotFoundError: no corpus manifest at /tmp/lm-dta"


def fail(failures, rank, code, *lines, seen=True, stepped=False, position=None):
  failures.begin(rank)  # a new process of that rank: its output anew
  for line in lines:
    failures.note(rank, f"[host 0] {line}\n".encode())
  return failures.recurs(rank, code, seen=seen, stepped=stepped, position=position)


def test_the_same_failure_twice_before_a_step_ends_the_job_naming_its_last_error():
  f = recurring.Failures()
  traceback = ("Traceback (most recent call last):", '  File "x.py", line 1', MISSING,
               "exiting")
  assert fail(f, 0, 1, *traceback) is None
  why = fail(f, 0, 1, *traceback)
  assert "2 times in a row before its first step" in why
  assert f"its last error: {MISSING})" in why  # the error line, not the last line
  assert "exited with code 1" in why


def test_without_an_error_line_its_last_line_is_compared_and_said():
  f = recurring.Failures()
  assert fail(f, 0, 3, "starting", "giving up") is None
  assert "its last error: giving up" in fail(f, 0, 3, "starting", "giving up")


@pytest.mark.parametrize("second", [
    (2, MISSING),
    (1, "ValueError: another mistake"),
], ids=["another-code", "another-error"])
def test_a_failure_that_changes_restarts(second):
  f = recurring.Failures()
  assert fail(f, 0, 1, MISSING) is None
  assert fail(f, 0, second[0], second[1]) is None


def test_a_trainer_its_sidecar_never_saw_is_restarted_whatever_it_says():
  # Failed before its Worker attached, or uses no sidecar (a Grain + Orbax trainer under
  # the same launcher): nothing tells its steps from none.
  f = recurring.Failures()
  for _ in range(3):
    assert fail(f, 0, 1, "RuntimeError: boom", seen=False) is None


def test_a_failure_after_a_step_restarts():
  f = recurring.Failures()
  assert fail(f, 0, 1, "RuntimeError: boom") is None
  assert fail(f, 0, 1, "RuntimeError: boom", stepped=True) is None  # its position unknown


def test_the_same_failure_at_the_same_step_twice_ends_the_job():
  f = recurring.Failures()
  assert fail(f, 0, 1, "RuntimeError: a bug", stepped=True, position=30) is None
  why = fail(f, 0, 1, "RuntimeError: a bug", stepped=True, position=30)
  assert why.startswith("it failed the same way 2 times in a row at the same point of its "
                        "run (30: the step it resumed from plus the batches its feeds handed "
                        "it, those sent ahead included, so not the step it raised in")
  assert "its last error: RuntimeError: a bug" in why


@pytest.mark.parametrize("second", [
    dict(position=34),  # it got further: a flaky failure
    dict(position=None),  # where it was is not known
    dict(position=30, code=2),
], ids=["another-step", "unknown-step", "another-code"])
def test_a_failure_at_another_or_an_unknown_step_restarts(second):
  f = recurring.Failures()
  assert fail(f, 0, 1, "RuntimeError: a bug", stepped=True, position=30) is None
  code = second.pop("code", 1)
  assert fail(f, 0, code, "RuntimeError: a bug", stepped=True, **second) is None
