"""Whether a trainer works (core/busy.py): rates of CPU seconds between readings."""

import pytest

from sidecar._src.core import busy

pytestmark = pytest.mark.unit


def test_a_rate_needs_two_readings_half_a_second_apart():
  s = busy.Samples()
  s.add("t", 10.0, at=100.0)
  assert s.rate("t") is None and s.busy("t") is None
  s.add("t", 10.1, at=100.3)
  assert s.rate("t") is None  # too close
  s.add("t", 10.5, at=101.0)
  assert s.rate("t") == pytest.approx(0.5) and s.busy("t")  # 100 .. 101
  s.add("t", 10.5, at=102.0)
  assert s.rate("t") == pytest.approx(0.5 / 2.0)  # one pause is no idle trainer: 100 .. 102
  s.add("t", 10.5, at=104.0)
  assert s.rate("t") == pytest.approx(0.0) and s.busy("t") is False  # at most 3 s: 101 .. 104


def test_the_work_before_its_last_step_is_not_its_work_since():
  """A trainer that stepped until 101 and then hung: judged on 101 .. now only."""
  s = busy.Samples()
  for t, cpu in ((100.0, 10.0), (100.5, 10.4), (101.0, 10.8), (101.5, 10.8), (102.0, 10.8)):
    s.add("t", cpu, at=t)
  assert s.busy("t") and not s.busy("t", since=101.0)
  assert s.rate("t", since=101.8) is None  # less than half a second since: not known


def test_a_member_that_ends_never_makes_a_rate_negative():
  s = busy.Samples()
  s.add("g", 20.0, at=0.0)
  s.add("g", 5.0, at=1.0)  # a data loader's worker ended: its 15 s left the group
  s.add("g", 5.5, at=2.0)
  assert s.rate("g") == pytest.approx(0.25)  # 0 .. 2, as if the worker's time stayed
  s.add("g", None, at=3.0)  # the group is gone
  assert s.rate("g") is None
  s.add("h", 1.0, at=0.0)
  s.keep_only(["g"])
  assert s.rate("h") is None
