"""sidecar launch's watchdog (tools/watchdog.py): what it hands the rule for failures that
recur (tools/recurring.py, tested in test_recurring.py): each trainer's last error line,
from the output it taps, and what its sidecar saw of it (attached, stepped, the step it
resumed from plus the batches it took). Tier 1: no sidecar (a Watchdog with no addresses
reads nothing; what a Status would say is set by hand)."""

import io
import os

import pytest

from sidecar._src.tools import trainers, watchdog

pytestmark = pytest.mark.unit


def dog():
  return watchdog.Watchdog(lambda: {}, token=None, say=lambda text: None)


def fail(d, rank, restart, code, *lines, seen=True):
  if seen:  # its sidecar saw it attach (Status.trainers)
    d._seen.add((rank, restart))
  out = d.tap(rank, io.BytesIO())
  for line in lines:
    out.write(f"[host 0] {line}\n".encode())
  return d.recurs(rank, restart, code)


def test_the_same_failure_twice_before_a_step_ends_the_job():
  d = dog()
  traceback = ("Traceback (most recent call last):", '  File "x.py", line 1',
               "FileNotFoundError: no corpus manifest at /tmp/lm-dta", "exiting")
  assert fail(d, 0, 0, 1, *traceback) is None
  why = fail(d, 0, 1, 1, *traceback)
  assert "2 times in a row before its first step" in why
  assert "its last error: FileNotFoundError: no corpus manifest at /tmp/lm-dta" in why


def test_a_trainer_its_sidecar_never_saw_is_restarted_whatever_it_says():
  # Failed before its Worker attached, or uses no sidecar (a Grain + Orbax trainer under
  # the same launcher): nothing tells its steps from none.
  d = dog()
  assert fail(d, 0, 0, 1, "RuntimeError: boom", seen=False) is None
  assert fail(d, 0, 1, 1, "RuntimeError: boom", seen=False) is None
  assert fail(d, 0, 2, 1, "RuntimeError: boom", seen=False) is None


def test_a_failure_after_a_step_restarts():
  d = dog()
  d._stepped.add((0, 1))  # its sidecar saw a step of start 1
  assert fail(d, 0, 0, 1, "RuntimeError: boom") is None
  assert fail(d, 0, 1, 1, "RuntimeError: boom") is None


def test_the_tap_passes_the_output_on_whole():
  d = dog()
  out = io.BytesIO()
  d.tap(0, out).write(b"[host 0] a\n[host 0] OSError: x\n")
  assert out.getvalue() == b"[host 0] a\n[host 0] OSError: x\n"


def at_step(d, rank, restart, code, line, *, resumed, taken):
  """A failure after its first step: its life resumed from step ``resumed`` and its feeds
  gave it ``taken`` batches (Status.trainers)."""
  d._stepped.add((rank, restart))
  d._resumed[restart] = resumed
  d._taken[(rank, restart)] = taken
  return fail(d, rank, restart, code, line)


def test_the_same_failure_at_the_same_step_twice_ends_the_job():
  """Issue 69: a bug in step 30 of every life; the second resumed from step 20."""
  d = dog()
  assert at_step(d, 0, 0, 1, "RuntimeError: a bug", resumed=0, taken=30) is None
  why = at_step(d, 0, 1, 1, "RuntimeError: a bug", resumed=20, taken=10)
  assert why.startswith("it failed the same way 2 times in a row at the same point of its "
                        "run (30: the step it resumed from plus the batches its feeds handed "
                        "it, those sent ahead included, so not the step it raised in")
  assert "its last error: RuntimeError: a bug" in why


@pytest.mark.parametrize("second", [
    dict(resumed=20, taken=14),  # it got further: a flaky failure
    dict(resumed=None, taken=10),  # what it resumed from is not known
], ids=["another-step", "unknown-step"])
def test_a_failure_at_another_or_an_unknown_step_restarts(second):
  d = dog()
  assert at_step(d, 0, 0, 1, "RuntimeError: a bug", resumed=0, taken=30) is None
  assert at_step(d, 0, 1, 1, "RuntimeError: a bug", **second) is None


@pytest.mark.parametrize("pid", [0, -1, -os.getpgrp(), trainers.PID_MAX + 1, 2**63, True,
                                 1.5, "7"],
                         ids=["zero", "minus-one", "minus-group", "over-pid-max", "2**63",
                              "bool", "float", "str"])
def test_an_impossible_pid_is_in_no_group(pid):
  assert not trainers.in_group(pid, os.getpgrp())


def test_a_pid_is_in_its_own_group_only():
  assert trainers.in_group(os.getpid(), os.getpgrp())
  assert not trainers.in_group(os.getpid(), os.getpgrp() + 1)
  assert not trainers.in_group(os.getpid(), -os.getpgrp())
  assert not trainers.in_group(trainers.PID_MAX, os.getpgrp())  # no such process
