"""sidecar launch's watchdog (tools/watchdog.py): the rule for failures that recur before a
first step, and the output tap that finds the last error line. Tier 1: no sidecar (a
Watchdog with no addresses reads nothing)."""

import io

import pytest

from sidecar._src.tools import watchdog

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


@pytest.mark.parametrize("second", [
    (2, "FileNotFoundError: no corpus manifest at /tmp/lm-dta"),
    (1, "ValueError: another mistake"),
], ids=["another-code", "another-error"])
def test_a_failure_that_changes_restarts(second):
  d = dog()
  assert fail(d, 0, 0, 1, "FileNotFoundError: no corpus manifest at /tmp/lm-dta") is None
  assert fail(d, 0, 1, second[0], second[1]) is None


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
