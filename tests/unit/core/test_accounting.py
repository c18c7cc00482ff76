"""The goodput ledger's accounting (core/accounting.py): a pure function of the events
(core/goodput.py's; their checks and their file: test_goodput.py).

Tier 1: events made by hand, nothing started. Each job below is a timeline written out
in seconds, so the expected split can be read off it.
"""

import json

import pytest

from sidecar._src.core import accounting
from sidecar._src.core.goodput import Counters, Event

pytestmark = pytest.mark.unit


def life(name, start, *, first=None, saves=(), restore=None, end=None, ended="died",
         data=0.0, ckpt=0.0, restore_s=0.0, first_blocked=(0.0, 0.0, 0.0)):
  """The events of one process life: started at ``start``; its first step done at
  ``first`` with ``first_blocked`` (data, ckpt, restore) counted by then; ``saves``:
  ``(t, step, ckpt_s counted by then)``; ``restore``: ``(t, step)``; ended at ``end``
  (``ended``: "died", "finish", or None: no end event, ``end`` is a mark's time);
  ``data``/``ckpt``/``restore_s``: the counters at the end."""
  def counters(d, c, r):
    return Counters(0, d, c, r)
  out = [Event("start", name, start + 0.5, counters(0, 0, 0), start=start, pid=1)]
  if restore is not None:
    out.append(Event("restore", name, restore[0], counters(0, 0, restore_s), step=restore[1]))
  if first is not None:
    out.append(Event("first_step", name, first, counters(*first_blocked)))
  for t, step, c in saves:
    out.append(Event("save", name, t, counters(first_blocked[0], c, first_blocked[2]),
                     step=step))
  if ended == "died":
    out += [Event("mark", name, end, counters(data, ckpt, restore_s)),
            Event("died", name, end)]
  elif ended == "finish":
    out.append(Event("finish", name, end, counters(data, ckpt, restore_s)))
  else:
    out.append(Event("mark", name, end, counters(data, ckpt, restore_s)))
  return out


def check_sum(ledger):
  total = ledger.productive_s + sum(ledger.badput_s.values())
  assert total == pytest.approx(ledger.wall_s, rel=1e-9)
  assert all(v >= -1e-9 for v in ledger.badput_s.values()) and ledger.productive_s >= 0


def test_a_clean_run_is_startup_then_productive_steps():
  # Starts at 0, first step done at 10 (2 s of it blocked on data), ends at 110 with
  # 5 s of data wait and 3 s of saves in all.
  ledger = accounting.account(life("a", 0.0, first=10.0, saves=[(50.0, 50, 1.0)], end=110.0,
                                ended="finish", data=5.0, ckpt=3.0,
                                first_blocked=(2.0, 0.0, 0.0)))
  check_sum(ledger)
  assert ledger.wall_s == 110.0
  assert ledger.badput_s == {"startup": 8.0, "data_wait": 5.0, "checkpoint": 3.0,
                             "restore": 0.0, "redone": 0.0, "stall": 0.0, "slow": 0.0,
                             "phase": 0.0, "restart_gap": 0.0}
  assert ledger.productive_s == pytest.approx(94.0)
  assert ledger.restarts == 0
  assert ledger.goodput == pytest.approx(94.0 / 110.0)


def test_a_kill_after_a_save_throws_away_what_came_after_it():
  # Life a saves step 50 at t=60 and dies at 80; life b starts at 85, restores step 50
  # (4 s) and finishes at 200.
  events = (life("a", 0.0, first=10.0, saves=[(60.0, 50, 1.0)], end=80.0, ckpt=1.0)
            + life("b", 85.0, restore=(93.0, 50), restore_s=4.0, first=100.0, end=200.0,
                   ended="finish", first_blocked=(0.0, 0.0, 4.0)))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.restarts == 1
  assert ledger.badput_s["restart_gap"] == pytest.approx(5.0)
  assert ledger.badput_s["redone"] == pytest.approx(20.0)  # 60 .. 80
  assert ledger.badput_s["restore"] == pytest.approx(4.0)
  assert ledger.badput_s["startup"] == pytest.approx(10.0 + 11.0)  # b: 85 .. 100 less 4
  assert ledger.productive_s == pytest.approx(49.0 + 100.0)  # a: 10 .. 60 less 1; b


def test_a_death_counts_from_the_last_sign_of_life_not_from_the_session_s_end():
  # Life a saves step 50 at t=60, marks at 70; the sidecar last heard from it at 72 (a
  # feed credit) and saw its session end at 76, once the killed process was gone.
  a = [e for e in life("a", 0.0, first=10.0, saves=[(60.0, 50, 1.0)], end=70.0, ckpt=1.0)
       if e.kind != "died"] + [Event("died", "a", 76.0, seen=72.0)]
  b = life("b", 80.0, restore=(81.0, 50), restore_s=1.0, first=90.0, end=100.0,
           ended="finish", first_blocked=(0.0, 0.0, 1.0))
  ledger = accounting.account(a + b)
  check_sum(ledger)
  assert ledger.badput_s["redone"] == pytest.approx(12.0)  # 60 .. 72
  assert ledger.badput_s["restart_gap"] == pytest.approx(8.0)  # 72 .. 80: the exit too
  assert ledger.lives[0].end == 72.0
  # A seen before the life's own last event (a mark) counts from that event; one after
  # the session's end (clocks) from the end.
  early = [e for e in a if e.kind != "died"] + [Event("died", "a", 76.0, seen=65.0)]
  assert accounting.account(early + b).lives[0].end == 70.0
  late = [e for e in a if e.kind != "died"] + [Event("died", "a", 76.0, seen=79.0)]
  assert accounting.account(late + b).lives[0].end == 76.0
  assert Event.from_dict(json.loads(Event("died", "a", 76.0, seen=72.0).line())).seen == 72.0


def test_a_resume_from_an_older_step_throws_away_more():
  # Life a saved 50 (t=40) and 60 (t=60), died at 80; step 60 was not committed, so life b
  # restored 50: everything after save(50) is re-done, save(60)'s blocked time apart.
  events = (life("a", 0.0, first=10.0, saves=[(40.0, 50, 1.0), (60.0, 60, 2.0)], end=80.0,
                 ckpt=2.0)
            + life("b", 80.0, restore=(81.0, 50), restore_s=1.0, first=90.0, end=100.0,
                   ended="finish", first_blocked=(0.0, 0.0, 1.0)))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.badput_s["redone"] == pytest.approx(39.0)  # 40 .. 80, less save(60)'s 1 s
  assert ledger.badput_s["checkpoint"] == pytest.approx(2.0)


def test_a_restart_from_scratch_throws_away_all_the_dead_lifes_steps():
  events = (life("a", 0.0, first=10.0, saves=[(30.0, 20, 1.0)], end=50.0, ckpt=1.0)
            + life("b", 52.0, first=60.0, end=100.0, ended="finish"))  # no restore
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.badput_s["redone"] == pytest.approx(39.0)  # 10 .. 50, less the save
  assert ledger.productive_s == pytest.approx(40.0)  # b's only
  assert ledger.lives[0].redone_from == 10.0


@pytest.mark.parametrize("first", [None, 5.0], ids=["before-first-step", "after-first-step"])
def test_a_kill_before_any_save(first):
  events = (life("a", 0.0, first=first, end=20.0)
            + life("b", 21.0, first=30.0, end=40.0, ended="finish"))
  ledger = accounting.account(events)
  check_sum(ledger)
  if first is None:  # all of a's life was startup
    assert ledger.badput_s["startup"] == pytest.approx(20.0 + 9.0)
    assert ledger.badput_s["redone"] == 0.0
  else:
    assert ledger.badput_s["redone"] == pytest.approx(15.0)
  assert ledger.badput_s["restart_gap"] == pytest.approx(1.0)
  assert ledger.restarts == 1


def test_several_kills_each_lose_their_tail():
  events = (life("a", 0.0, first=10.0, saves=[(20.0, 10, 0.0)], end=30.0)
            + life("b", 31.0, restore=(35.0, 10), first=40.0, saves=[(50.0, 20, 0.0)],
                   end=55.0)
            + life("c", 57.0, restore=(60.0, 20), first=65.0, end=75.0, ended="finish"))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.restarts == 2
  assert ledger.badput_s["redone"] == pytest.approx(10.0 + 5.0)
  assert ledger.badput_s["restart_gap"] == pytest.approx(1.0 + 2.0)
  assert [x.ended for x in ledger.lives] == ["died", "died", "finish"]


def test_a_job_that_ended_in_a_death_loses_what_followed_its_last_save():
  ledger = accounting.account(life("a", 0.0, first=10.0, saves=[(30.0, 5, 0.0)], end=45.0))
  check_sum(ledger)
  assert ledger.badput_s["redone"] == pytest.approx(15.0)
  assert ledger.restarts == 0


def test_a_running_job_counts_up_to_its_last_mark_and_loses_nothing_yet():
  ledger = accounting.account(life("a", 0.0, first=10.0, end=40.0, ended=None))
  check_sum(ledger)
  assert ledger.wall_s == 40.0 and ledger.badput_s["redone"] == 0.0
  assert ledger.productive_s == pytest.approx(30.0)


def test_a_life_whose_end_was_never_seen_counts_as_a_restart_at_its_last_event():
  events = (life("a", 0.0, first=10.0, saves=[(20.0, 3, 0.0)], end=25.0, ended=None)
            + life("b", 30.0, restore=(31.0, 3), first=35.0, end=40.0, ended="finish"))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.restarts == 1
  assert ledger.badput_s["restart_gap"] == pytest.approx(5.0)
  assert ledger.badput_s["redone"] == pytest.approx(5.0)


def test_the_time_between_a_finish_and_a_later_run_is_no_ones():
  events = (life("a", 0.0, first=1.0, saves=[(5.0, 5, 0.0)], end=10.0, ended="finish")
            + life("b", 1000.0, restore=(1001.0, 5), first=1002.0, end=1010.0,
                   ended="finish"))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.wall_s == pytest.approx(20.0)
  assert ledger.restarts == 0 and ledger.badput_s["restart_gap"] == 0.0


def test_a_next_life_that_seems_to_start_before_the_death_is_clipped():
  # The sidecar saw the death late (its clock, or the socket's end came late).
  events = (life("a", 0.0, first=1.0, end=10.0)
            + life("b", 9.0, first=12.0, end=20.0, ended="finish"))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.wall_s == pytest.approx(20.0)
  assert ledger.badput_s["restart_gap"] == 0.0


def test_no_events_is_an_empty_ledger():
  ledger = accounting.account([])
  assert (ledger.wall_s, ledger.productive_s, ledger.goodput, ledger.restarts) == (0, 0, 0, 0)


def test_the_table_names_every_category_and_the_share():
  text = accounting.table(accounting.account(life("a", 0.0, first=10.0, end=20.0, ended="finish")))
  for name in ("productive", *accounting.CATEGORIES, "wall"):
    assert name in text
  assert "goodput 50.00%" in text


def test_each_life_says_the_step_it_resumed_from_and_where_it_rolled_back_to():
  # Life a starts from scratch, saves 50, dies; life b restores 50 before its first step,
  # saves 100 and rolls back to it in-process (a restore after its first step).
  events = (life("a", 0.0, first=10.0, saves=[(60.0, 50, 1.0)], end=80.0, ckpt=1.0)
            + life("b", 85.0, restore=(93.0, 50), restore_s=4.0, first=100.0,
                   saves=[(150.0, 100, 1.0)], end=200.0, ended="finish",
                   first_blocked=(0.0, 0.0, 4.0)))
  events.insert(-1, Event("restore", "b", 170.0, Counters(0, 0.0, 1.0, 4.0), step=100))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert [x.resumed_from for x in ledger.lives] == [None, 50]
  assert [x.rollbacks for x in ledger.lives] == [(), ((170.0, 100),)]
  # The rollback is no resume: life a's steps after its save of 50 are what b threw away.
  assert ledger.lives[0].redone_from == 60.0


def test_a_restart_killed_before_it_restored_decides_nothing():
  # Life a saves step 50 at 60 and dies at 80; life b starts at 85 and is killed at 86,
  # before it restored anything; life c restores 50: a's steps up to its save are kept.
  events = (life("a", 0.0, first=10.0, saves=[(60.0, 50, 1.0)], end=80.0, ckpt=1.0)
            + life("b", 85.0, end=86.0)
            + life("c", 90.0, restore=(93.0, 50), restore_s=2.0, first=100.0, end=150.0,
                   ended="finish", first_blocked=(0.0, 0.0, 2.0)))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.lives[0].redone_from == 60.0
  assert ledger.badput_s["redone"] == pytest.approx(20.0)
  # The same where the job ends with b (the window's end): a's last save is kept.
  ledger = accounting.account(events[:-4])
  assert ledger.lives[0].redone_from == 60.0 and ledger.restarts == 1


def test_a_rollback_throws_away_the_steps_since_the_save_it_restored():
  # Life a saves step 50 at 60 (1 s blocked), a step raises and it rolls back in-process
  # to step 50, restored at 80 (2 s), and finishes at 120: 60 .. 80 less the restore
  # was computed again after the rollback.
  events = life("a", 0.0, first=10.0, saves=[(60.0, 50, 1.0)], end=120.0, ended="finish",
                ckpt=1.0, restore_s=2.0)
  events.insert(-1, Event("restore", "a", 80.0, Counters(0, 0.0, 1.0, 2.0), step=50))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.badput_s["redone"] == pytest.approx(18.0)
  assert ledger.badput_s["restore"] == pytest.approx(2.0)
  assert ledger.productive_s == pytest.approx(110.0 - 1.0 - 2.0 - 18.0)
  assert ledger.lives[0].rolled_back == ((60.0, 80.0),)


def test_a_rollback_then_a_death_throw_away_the_same_steps_once():
  # As above, but life a dies at 100 with no later save: life b resumes from step 50
  # too, so 60 .. 100 is thrown away: the rollback's 60 .. 80 inside it, counted once.
  events = (life("a", 0.0, first=10.0, saves=[(60.0, 50, 1.0)], end=100.0, ckpt=1.0,
                 restore_s=2.0)
            + life("b", 105.0, restore=(107.0, 50), restore_s=1.0, first=110.0, end=150.0,
                   ended="finish", first_blocked=(0.0, 0.0, 1.0)))
  events.insert(3, Event("restore", "a", 80.0, Counters(0, 0.0, 1.0, 2.0), step=50))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.badput_s["redone"] == pytest.approx(40.0 - 2.0)
  assert ledger.lives[0].redone_from == 60.0


def test_a_rollback_to_the_step_it_resumed_from_throws_away_all_its_steps_before():
  # Life b resumed from step 50 and rolls back to it at 140 having saved nothing since.
  events = life("b", 100.0, restore=(103.0, 50), restore_s=1.0, first=110.0, end=170.0,
                ended="finish", first_blocked=(0.0, 0.0, 1.0))
  events.insert(-1, Event("restore", "b", 140.0, Counters(0, 0.0, 0.0, 1.5), step=50))
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.badput_s["redone"] == pytest.approx(30.0 - 0.5)  # 110 .. 140, less its restore
  assert ledger.lives[0].rolled_back == ((110.0, 140.0),)


def test_the_blocked_time_is_drawn_where_the_events_counted_it():
  # Restored 3 s up to t=5; 1 s of data wait by the first step (t=10); a save that
  # blocked 2 s up to t=20, 0.5 s more data wait before it; 0.5 s closing at t=30.
  events = [Event("start", "a", 0.5, Counters(), start=0.0, pid=1),
            Event("restore", "a", 5.0, Counters(0, 0.0, 0.0, 3.0), step=7),
            Event("first_step", "a", 10.0, Counters(2, 1.0, 0.0, 3.0)),
            Event("save", "a", 20.0, Counters(9, 1.5, 2.0, 3.0), step=9),
            Event("finish", "a", 30.0, Counters(20, 1.5, 2.5, 3.0))]
  [one] = accounting.account(events).lives
  assert one.blocked == ((2.0, 5.0, "restore"), (9.0, 10.0, "data_wait"),
                         (17.5, 18.0, "data_wait"), (18.0, 20.0, "checkpoint"),
                         (29.5, 30.0, "checkpoint"))
  assert sum(b - a for a, b, _ in one.blocked) == pytest.approx(
      one.seconds["data_wait"] + one.seconds["checkpoint"] + one.seconds["restore"])


# ---- stall (issue 64.1) ----------------------------------------------------------------

def test_a_stalled_death_counts_its_last_step_to_its_end_as_stall():
  # First step at 10, saved step 50 at 50, last step at 80, found stalled (and killed)
  # at 90; the next life starts at 100 and resumes from step 50.
  a = life("a", 0.0, first=10.0, saves=[(50.0, 50, 0.0)], end=80.0)
  a[-1] = Event("died", "a", 95.0, seen=90.0, stalled=80.0)
  b = life("b", 100.0, first=110.0, restore=(105.0, 50), end=120.0, ended="finish")
  ledger = accounting.account(a + b)
  check_sum(ledger)
  assert ledger.badput_s["stall"] == pytest.approx(10.0)
  assert ledger.badput_s["redone"] == pytest.approx(30.0)  # 50 .. 80
  assert ledger.badput_s["restart_gap"] == pytest.approx(10.0)  # 90 .. 100
  assert ledger.lives[0].seconds["stall"] == pytest.approx(10.0)
  assert "stall" in ledger.to_dict()["badput_s"]


def test_a_running_life_its_sidecar_finds_stalled_counts_its_hang_as_stall_so_far():
  """Issue 79 item 3: `sidecar goodput` during a hang counted it as productive (or not at
  all). Its view of a running life (tools/goodput_live.py) ends with a mark now that says
  since when it is stalled: the time from its last step is stall, nothing is redone."""
  events = life("a", 0.0, first=10.0, saves=[(50.0, 50, 0.0)], end=60.0, ended=None)
  assert accounting.account(events).badput_s["stall"] == 0.0
  hang = Event("mark", "a", 100.0, Counters(0, 0.0, 0.0, 0.0), stalled=70.0)
  ledger = accounting.account([*events, hang])
  check_sum(ledger)
  assert ledger.wall_s == 100.0 and ledger.lives[-1].ended == "running"
  assert ledger.badput_s["stall"] == pytest.approx(30.0)  # its last step at 70 .. now
  assert ledger.badput_s["redone"] == 0.0  # it runs: nothing is thrown away yet
  assert ledger.productive_s == pytest.approx(60.0)  # 10 .. 70


def test_a_phase_and_a_slow_gap_are_what_they_were_never_steps():
  """Issue 77: an evaluation the trainer announced counts under its name, a gap without a
  step past the stall timeout that ended in a step as ``slow``; both out of step time, so
  neither productive nor re-done where the life dies after them."""
  events = life("a", 0.0, first=10.0, saves=[(50.0, 50, 1.0)], end=110.0, ended="finish",
                data=5.0, ckpt=3.0, first_blocked=(2.0, 0.0, 0.0))
  events[-1:-1] = [Event("phase", "a", 30.0, begin=20.0, name="eval"),
                   Event("slow", "a", 68.0, begin=60.0)]
  ledger = accounting.account(events)
  check_sum(ledger)
  assert ledger.badput_s["phase"] == pytest.approx(10.0) and ledger.phases == {"eval": 10.0}
  assert ledger.badput_s["slow"] == pytest.approx(8.0)
  assert ledger.productive_s == pytest.approx(94.0 - 18.0)
  assert "  eval" in accounting.table(ledger) and ledger.to_dict()["phases_s"] == {"eval": 10.0}
  died = life("b", 0.0, first=10.0, saves=[(50.0, 50, 0.0)], end=110.0)
  died[-1:-1] = [Event("slow", "b", 90.0, begin=70.0)]
  ledger = accounting.account(died)
  check_sum(ledger)
  assert ledger.badput_s["slow"] == pytest.approx(20.0)
  assert ledger.badput_s["redone"] == pytest.approx(60.0 - 20.0)  # 50 .. 110, less the gap
