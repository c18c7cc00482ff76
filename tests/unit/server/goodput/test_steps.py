"""Each trainer's step progress (server/goodput/steps.py) and the stall rule (core/stall.py).

Tier 1: a Steps with hand-moved clocks; no server.
"""

import os

import pytest

from sidecar._src.core import procfs, stall
from sidecar._src.server.goodput import steps

pytestmark = pytest.mark.unit


@pytest.fixture
def clock():
  return {"t": 1000.0}


def make(clock, floor=10.0):
  return steps.Steps(floor, clock=lambda: clock["t"] + 1.7e9, monotonic=lambda: clock["t"])


def started(s, session="w-1"):
  """Its Controller says its first step completed (controller/startup.py)."""
  s.phase(session, stall.Phase(stall.STARTUP))


def test_no_trainer_is_stalled_before_its_first_step(clock):
  s = make(clock)
  s.attach("w-1", pid=7, rank=0, restart=0)
  clock["t"] += 3600  # its compile, its imports: never watched
  [t] = s.trainers()
  assert not t.stalled and t.since_step_s is None and t.steps == 0


def test_batches_taken_before_the_first_completed_step_start_no_clock(clock):
  """Issue 69: the first batch is taken before the first step's compile (a prefetch
  thread takes several): a compile longer than the floor is no stall; the clock starts
  where the trainer says its first step completed, and the compile is no slow step."""
  s = make(clock)
  s.attach("w-1", pid=7, rank=0, restart=0)
  s.step("w-1", taken=1)
  s.step("w-1", taken=8)
  clock["t"] += 3 * 10.0  # the compile: 3x the floor
  [t] = s.trainers()
  assert not t.stalled and t.since_step_s is None and t.steps == 9
  started(s)
  s.step("w-1", taken=1)
  [t] = s.trainers()
  assert t.since_step_s == 0 and t.slowest_s == 0 and t.timeout_s == 10.0
  clock["t"] += 10.5
  assert s.trainers()[0].stalled  # from its first completed step, the rule holds
  started(s)  # said again (a second Controller): no step
  assert s.trainers()[0].stalled


def test_a_trainer_with_no_feed_is_timed_from_its_second_save(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  s.step("w-1", saves=1)  # step 0's save, before the compile
  clock["t"] += 100.0
  assert s.trainers()[0].since_step_s is None
  s.step("w-1", saves=1)  # its clock starts; the 100 s from its first save is a step
  clock["t"] += 999.0
  [t] = s.trainers()
  assert not t.stalled and t.slowest_s == pytest.approx(100.0) and t.timeout_s == 1000.0
  clock["t"] += 1.5
  assert s.trainers()[0].stalled  # 10x its save interval without a save


def test_a_trainer_that_saves_less_often_than_the_floor_is_not_stalled_between_saves(clock):
  s = make(clock)  # floor 10 s; saves every 30 s, no feed
  s.attach("w-1", pid=7)
  for _ in range(4):
    s.step("w-1", saves=1)
    clock["t"] += 30.0
    assert not s.trainers()[0].stalled


def test_a_trainer_is_stalled_after_the_floor_without_a_step(clock):
  s = make(clock)
  me = os.getpid()
  s.attach("w-1", pid=me, pid_start=procfs.start(me), rank=3, restart=1, tenant="alice")
  started(s)
  for _ in range(5):
    clock["t"] += 0.5
    s.step("w-1")
  clock["t"] += 10.0
  assert not s.trainers()[0].stalled  # not more than its timeout
  clock["t"] += 0.5
  [t] = s.trainers()
  assert t.stalled and (t.pid, t.rank, t.restart, t.tenant) == (me, 3, 1, "alice")
  assert t.since_step_s == pytest.approx(10.5) and t.timeout_s == 10.0
  clock["t"] += 1.0
  s.step("w-1")  # it moved again
  assert not s.trainers()[0].stalled


def test_a_slow_step_seen_once_raises_the_timeout(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  started(s)
  clock["t"] += 4.0  # a save, a recompile
  s.step("w-1")
  clock["t"] += 30.0
  [t] = s.trainers()
  assert t.timeout_s == stall.MULTIPLE * 4.0 and not t.stalled


def test_a_floor_of_zero_never_stalls(clock):
  s = make(clock, floor=0)
  s.attach("w-1", pid=7)
  started(s)
  clock["t"] += 1e6
  assert not s.trainers()[0].stalled and s.trainers()[0].timeout_s == 0


def test_a_ledger_count_is_a_step_only_where_it_grew(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  started(s)
  s.step("w-1", batches=5)
  clock["t"] += 2.0
  s.step("w-1", batches=5)
  s.step("w-1", batches=3)
  assert s.trainers()[0].since_step_s == 2.0


def test_an_ended_session_tells_its_stall_and_stays_listed_a_while(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  started(s)
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
  started(s)
  s.heard("w-1")
  clock["t"] += 1.0
  assert s.end("w-1").stalled is None


def test_a_tenant_sees_its_own_trainers_only(clock):
  s = make(clock)
  a, b = os.getpid(), os.getppid()
  s.attach("w-a", pid=a, pid_start=procfs.start(a), tenant="alice")
  s.attach("w-b", pid=b, pid_start=procfs.start(b), tenant="bob")
  assert [t.pid for t in s.trainers("alice", every=False)] == [a]
  assert sorted(t.pid for t in s.trainers()) == sorted([a, b])


def test_a_sessions_pid_is_listed_only_while_its_process_lives(clock):
  """Issue 76, attack 5: the process that connected exits and its session lives on (its
  connection held elsewhere): its pid is listed as 0 from then on, whoever gets it next
  (another start: tests/processes/tools/test_watchdog_pids.py makes it happen); a pid with
  no start known is never listed."""
  s = make(clock)
  me = os.getpid()
  s.attach("w-gone", pid=procfs.PID_MAX, pid_start=procfs.start(me), rank=0)  # no process
  s.attach("w-none", pid=me, pid_start=None, rank=1)  # its start unknown
  s.attach("w-other", pid=me, pid_start=procfs.start(me) + 1, rank=2)  # another's start
  s.attach("w-me", pid=me, pid_start=procfs.start(me), rank=3)
  assert {t.rank: t.pid for t in s.trainers()} == {0: 0, 1: 0, 2: 0, 3: me}


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), True, "10"],
                         ids=["negative", "inf", "nan", "bool", "str"])
def test_a_bad_floor_is_refused(bad):
  with pytest.raises(ValueError, match="stall timeout must be seconds >= 0"):
    steps.Steps(bad)


def test_a_long_phase_has_its_budget_and_never_counts_as_the_slowest_step(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  started(s)
  s.phase("w-1", stall.Phase("eval", 300.0))
  clock["t"] += 250.0  # 25x the floor, within its budget
  [t] = s.trainers()
  assert not t.stalled and t.timeout_s == 300.0 and t.phase == "eval"
  s.phase("w-1", stall.Phase("other"))  # not the phase it is in: nothing ends
  assert s.trainers()[0].phase == "eval"
  s.phase("w-1", stall.Phase("eval"))
  [t] = s.trainers()
  assert t.phase is None and t.since_step_s == 0 and t.slowest_s == 0 and t.timeout_s == 10
  clock["t"] += 10.5
  assert s.trainers()[0].stalled  # after it, the rule as before


def test_a_phase_over_its_budget_is_a_stall_and_its_ledger_says_so(clock):
  s = make(clock)
  s.attach("w-1", pid=7)
  started(s)
  s.phase("w-1", stall.Phase("eval", 60.0))
  begun = clock["t"] + 1.7e9
  clock["t"] += 61.0
  assert s.trainers()[0].stalled
  ended = s.end("w-1")
  assert ended.stalled == begun and ended.seen == begun + 60.0


@pytest.mark.parametrize("name, budget, match", [
    ("", 10.0, "1 to 64 printable"),
    ("x" * 65, 10.0, "1 to 64 printable"),
    ("a\nb", 10.0, "1 to 64 printable"),
    (7, 10.0, "1 to 64 printable"),
    ("eval", 0.0, "budget must be seconds in"),
    ("eval", -5.0, "budget must be seconds in"),
    ("eval", stall.MAX_BUDGET_S * 2, "budget must be seconds in"),
    ("eval", float("nan"), "budget must be seconds in"),
    ("eval", float("inf"), "budget must be seconds in"),
    ("eval", True, "budget must be seconds in"),
    ("eval", "60", "budget must be seconds in"),
    (stall.STARTUP, 10.0, "every trainer begins in"),
], ids=["empty", "long", "newline", "int-name", "zero", "negative", "over-max", "nan", "inf",
        "bool", "str", "startup"])
def test_a_bad_phase_is_refused(name, budget, match):
  with pytest.raises(ValueError, match=match):
    stall.Phase(name, budget)
  with pytest.raises(ValueError, match=match):
    stall.Phase.from_dict({"op": stall.OP, "name": name, "budget_s": budget})


def test_a_phase_crosses_as_its_frame():
  begins = stall.Phase("eval", 90.0)
  assert stall.Phase.from_dict(begins.to_dict()) == begins
  assert stall.Phase.from_dict(stall.Phase("eval").to_dict()).ends


def test_the_sessions_of_a_start_are_listed_by_tenant_live_ones_only(clock):
  """What a Stalled report marks (server/workers/workers.py): the live sessions of that
  start, of the caller's tenant."""
  s = make(clock)
  s.attach("w-1", pid=7, rank=0, restart=1, tenant="alice")
  s.attach("w-2", pid=8, rank=1, restart=1, tenant="bob")
  s.attach("w-3", pid=9, rank=0, restart=0, tenant="alice")
  s.attach("w-4", pid=10, rank=1, restart=1, tenant="alice")
  s.end("w-4")
  attached = 1000.0 + 1.7e9
  assert s.of_start(1) == [("w-1", attached), ("w-2", attached)]
  assert s.of_start(1, "alice", every=False) == [("w-1", attached)]
  assert s.of_start(2) == []


def test_a_phase_and_a_slow_gap_go_to_the_ledger_as_they_were(clock):
  """Issue 77: a phase that ended, from its start; a gap past the timeout that ended in a
  step, ``slow``; a gap within it, and a gap inside a phase, nothing."""
  told = []
  s = steps.Steps(10.0, clock=lambda: clock["t"] + 1.7e9, monotonic=lambda: clock["t"],
                  on_gap=lambda *gap: told.append(gap))
  s.attach("w-1", pid=0)
  s.phase("w-1", stall.Phase("eval", 60.0))  # before its first step: startup's
  s.phase("w-1", stall.Phase("eval"))
  started(s)
  clock["t"] += 0.9
  s.step("w-1", taken=1)  # within the timeout: a step (the timeout stays the floor's 10 s)
  clock["t"] += 20.1
  s.step("w-1", taken=1)  # past it (the watchdog found it slow), then a step
  s.phase("w-1", stall.Phase("eval", 60.0))
  clock["t"] += 30.0
  s.step("w-1", taken=1)  # inside the phase: the phase's
  s.phase("w-1", stall.Phase("eval"))
  assert told == [("w-1", "slow", None, 1000.0 + 0.9 + 1.7e9, 1000.0 + 21.0 + 1.7e9),
                  ("w-1", "phase", "eval", 1000.0 + 21.0 + 1.7e9, 1000.0 + 51.0 + 1.7e9)]
