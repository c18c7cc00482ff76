"""benchmarks.goodput's mechanics: the failure schedule, and the outside ledger's
accounting of kills, hangs and errors survived in-process (goodput_ledger.py), on
timelines written out here in seconds, so the expected split can be read off them."""

import pytest

from benchmarks import goodput_ledger as ledger
from benchmarks.goodput_job import Job, failure_schedule, kill_schedule
from benchmarks.goodput_ledger import Life, Line

pytestmark = pytest.mark.unit


def lines(*spans: tuple[int, int, float, float]) -> list[Line]:
  """Step lines: for each ``(first, last, t_first, dt)``, steps first..last a ``dt`` apart."""
  out = []
  for first, last, t, dt in spans:
    out += [Line(step, float(step), t + (step - first) * dt) for step in range(first, last + 1)]
  return out


def check_sum(a: ledger.Account) -> None:
  assert a.productive_s + sum(a.badput_s.values()) == pytest.approx(a.wall_s)
  assert sum(c.total_s for c in a.costs) == pytest.approx(
      sum(a.badput_s[k] for k in ledger.CHARGED) - a.startups[0])


# ---- the schedule -------------------------------------------------------------------------

def test_the_kinds_come_in_turn_at_the_kill_only_times():
  times = kill_schedule(seed=35, mtbf=12, wall=60)
  mixed = failure_schedule(seed=35, mtbf=12, wall=60, kinds=("kill", "error", "hang"))
  assert [t for t, _ in mixed] == list(times) and len(times) == 3
  assert [k for _, k in mixed] == ["kill", "error", "hang"]
  more = failure_schedule(seed=1, mtbf=5, wall=100, kinds=("error", "hang"))
  assert len(more) > 4
  assert [k for _, k in more] == [("error", "hang")[i % 2] for i in range(len(more))]
  assert failure_schedule(seed=35, mtbf=12, wall=60) == tuple((t, "kill") for t in times)


@pytest.mark.parametrize("kinds", [(), ("kill", "crash")], ids=["none", "unknown"])
def test_a_kind_not_known_is_refused_naming_the_kinds(kinds):
  with pytest.raises(ValueError, match="kill, hang, error"):
    failure_schedule(seed=0, mtbf=10, wall=60, kinds=kinds)


# ---- the ledger -------------------------------------------------------------------------

def test_a_kill_is_charged_its_lost_steps_the_gap_and_the_next_startup():
  # Steps 1-20 a second apart from t=10 (the last at 29; saved at 10, as the lines show:
  # 11-20 are computed again); killed at 30.5; the next process starts at 31, steps 11..
  # from 36.
  a = ledger.account(lines((1, 20, 10.0, 1.0), (11, 30, 36.0, 1.0)),
                     [Life(5.0, 30.5, "kill"), Life(31.0, None)], t0=0.0, t_end=56.0)
  check_sum(a)
  [cost] = a.costs
  assert (cost.kind, cost.recovered) == ("kill", True)
  assert cost.seconds == pytest.approx({"startup": 4.0, "redone": 10.0 + 1.5, "stall": 0.0,
                                        "rollback": 0.0, "gap": 0.5})
  assert a.per_failure() == pytest.approx({"startup": 4.0, "redone": 11.5, "gap": 0.5})
  assert a.badput_s["launch"] == 5.0 and a.startups[0] == 4.0


def test_a_hang_is_a_stall_from_its_last_step_to_the_kill():
  # The last step at 20; the launcher kills it at 29 (its stall timeout); the next
  # process starts at 30 and resumes after step 10.
  a = ledger.account(lines((1, 11, 10.0, 1.0), (11, 20, 31.0, 1.0)),
                     [Life(5.0, 29.0, "hang"), Life(30.0, None)], t0=0.0, t_end=40.0)
  check_sum(a)
  assert a.badput_s["stall"] == pytest.approx(29.0 - 20.0)
  assert a.badput_s["other"] == 0.0
  [cost] = a.costs
  assert cost.kind == "hang" and cost.seconds["stall"] == pytest.approx(9.0)
  assert cost.seconds["redone"] == pytest.approx(1.0)  # step 11, computed again
  assert cost.seconds["gap"] == pytest.approx(1.0) and cost.recovered


def test_a_hang_nothing_ends_costs_the_rest_of_the_window():
  a = ledger.account(lines((1, 10, 10.0, 1.0)), [Life(5.0, None, "hang")], t0=0.0,
                     t_end=60.0)
  check_sum(a)
  [cost] = a.costs
  assert cost.seconds["stall"] == pytest.approx(60.0 - 19.0) and not cost.recovered
  assert a.by_kind() == {"hang": {"failures": 1, "recovered": 0, "total_s": pytest.approx(41.0),
                                  "per_failure_s": pytest.approx({
                                      "startup": 0.0, "redone": 0.0, "gap": 0.0,
                                      "stall": 41.0})}}


def test_an_error_survived_in_process_is_a_rollback_and_the_steps_it_threw_away():
  # Steps 1-25 a second apart from t=10 (the last at 34); step 26 raises at 35.2; rolled
  # back to step 20, the first step after it (21) at 36.5: its line's 2.5 s hold one
  # step and 1.5 s of rollback. Steps 21-25's first computations are thrown away.
  a = ledger.account(lines((1, 25, 10.0, 1.0), (21, 40, 36.5, 1.0)),
                     [Life(5.0, None, caught=(35.2,))], t0=0.0, t_end=56.0)
  check_sum(a)
  [cost] = a.costs
  assert (cost.kind, cost.recovered) == ("error", True)
  assert cost.seconds == pytest.approx({"startup": 0.0, "redone": 5.0, "stall": 0.0,
                                        "rollback": 1.5, "gap": 0.0})
  assert a.productive_s == pytest.approx(40.0)  # one second for each of steps 1..40
  assert a.badput_s["other"] == pytest.approx(56.0 - 55.5)


def test_steps_thrown_away_are_charged_to_the_first_failure_after_them():
  # An error at 25.5, rolled back to step 10 (saved before); steps 11-15 computed again
  # from 27; killed at 34.5 and resumed from step 10 by the next process: the second
  # computations of 11-18 are the kill's, the first of 11-15 the error's.
  a = ledger.account(lines((1, 15, 10.0, 1.0), (11, 18, 27.0, 1.0), (11, 20, 40.0, 1.0)),
                     [Life(5.0, 34.5, "kill", caught=(25.5,)), Life(35.0, None)],
                     t0=0.0, t_end=50.0)
  check_sum(a)
  error, kill = a.costs
  assert (error.kind, kill.kind) == ("error", "kill")
  assert error.seconds["redone"] == pytest.approx(5.0)
  assert error.seconds["rollback"] == pytest.approx(27.0 - 24.0 - 1.0)
  assert kill.seconds["redone"] == pytest.approx(8.0 + 0.5)
  assert kill.seconds["startup"] == pytest.approx(4.0) and kill.seconds["gap"] == 0.5
  assert set(a.by_kind()) == {"kill", "error"}


# ---- a job's lives, from its records ---------------------------------------------------

def test_a_job_tells_a_survived_error_from_one_that_ended_its_process(tmp_path):
  job = Job("ours", name="j", config="tiny", data="d", work=str(tmp_path), save_every=10,
            env={}, shm="64MiB", restarts=1)
  job.lives = {
      11: {"start": 5.0, "end": 30.0, "failure": None, "hung": False},  # error, then ended
      12: {"start": 31.0, "end": 60.0, "failure": "kill", "hung": False},  # survived one
      13: {"start": 61.0, "end": None, "failure": None, "hung": True}}  # hung
  job.lines = lines((1, 19, 10.0, 1.0), (11, 40, 36.0, 1.0), (30, 35, 66.0, 1.0))
  with open(job.log, "w") as f:
    f.write("[host 0] fault: injected error in step 20 (pid 11) at unix 29.5\n"
            "[host 0] fault: injected error in step 30 (pid 12) at unix 45.5\n"
            "[host 0] fault: injected hang in step 36 (pid 13) at unix 71.2\n")
  assert job.life_records() == [Life(5.0, 30.0, "error"), Life(31.0, 60.0, "kill", (45.5,)),
                                Life(61.0, None, "hang")]
