"""Each trainer's step progress (server/goodput/steps.py) and the stall rule (core/stall.py).

Tier 1: a Steps with hand-moved clocks; no server.
"""

import pytest

from sidecar._src.core import stall
from sidecar._src.server.goodput import steps

pytestmark = pytest.mark.unit


@pytest.fixture
def clock():
  return {"t": 1000.0}


def make(clock, floor=10.0):
  return steps.Steps(floor, clock=lambda: clock["t"] + 1.7e9, monotonic=lambda: clock["t"])


def test_no_trainer_is_stalled_before_its_first_step(clock):
  s = make(clock)
  s.attach("w-1", pid=7, rank=0, restart=0)
  clock["t"] += 3600  # its compile, its imports: never watched
  [t] = s.trainers()
  assert not t.stalled and t.since_step_s is None and t.steps == 0


def test_a_trainer_is_stalled_after_the_floor_without_a_step(clock):
  s = make(clock)
  s.attach("w-1", pid=7, rank=3, restart=1, tenant="alice")
  for _ in range(5):
    clock["t"] += 0.5
    s.step("w-1")
  clock["t"] += 10.0
  assert not s.trainers()[0].stalled  # not more than its timeout
  clock["t"] += 0.5
  [t] = s.trainers()
  assert t.stalled and (t.pid, t.rank, t.restart, t.tenant) == (7, 3, 1, "alice")
  assert t.since_step_s == pytest.approx(10.5) and t.timeout_s == 10.0
  clock["t"] += 1.0
  s.step("w-1")  # it moved again
  assert not s.trainers()[0].stalled


def test_a_slow_step_seen_once_raises_the_timeout(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  s.step("w-1")
  clock["t"] += 4.0  # a save, an evaluation
  s.step("w-1")
  clock["t"] += 30.0
  [t] = s.trainers()
  assert t.timeout_s == stall.MULTIPLE * 4.0 and not t.stalled


def test_a_floor_of_zero_never_stalls(clock):
  s = make(clock, floor=0)
  s.attach("w-1", pid=7)
  s.step("w-1")
  clock["t"] += 1e6
  assert not s.trainers()[0].stalled and s.trainers()[0].timeout_s == 0


def test_a_ledger_count_is_a_step_only_where_it_grew(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  s.step("w-1", batches=5)
  s.step("w-1", batches=5)
  s.step("w-1", batches=3)
  assert s.trainers()[0].steps == 1


def test_an_ended_session_tells_its_stall_and_stays_listed_a_while(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  s.step("w-1")
  last = clock["t"] + 1.7e9
  clock["t"] += 25.0
  ended = s.end("w-1")
  assert ended.stalled == last and ended.seen == last + 10.0  # declared at its timeout
  [t] = s.trainers()
  assert t.ended and t.stalled
  clock["t"] += steps.KEEP_ENDED_S + 1
  assert s.trainers() == []
  assert s.end("w-1") is None


def test_a_session_that_ends_moving_is_no_stall(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  s.step("w-1")
  s.heard("w-1")
  clock["t"] += 1.0
  assert s.end("w-1").stalled is None


def test_a_tenant_sees_its_own_trainers_only(clock):
  s = make(clock)
  s.attach("w-a", pid=1, tenant="alice")
  s.attach("w-b", pid=2, tenant="bob")
  assert [t.pid for t in s.trainers("alice", every=False)] == [1]
  assert sorted(t.pid for t in s.trainers()) == [1, 2]


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), True, "10"],
                         ids=["negative", "inf", "nan", "bool", "str"])
def test_a_bad_floor_is_refused(bad):
  with pytest.raises(ValueError, match="stall timeout must be seconds >= 0"):
    steps.Steps(bad)
