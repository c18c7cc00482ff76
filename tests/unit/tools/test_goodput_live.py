"""``sidecar goodput`` during a run (tools/goodput_live.py): the running life's open gap,
counted as its sidecar says it is. Tier 1: ledgers and Status records made here."""

import pytest

from sidecar._src.core import accounting
from sidecar._src.core.goodput import Counters, Event
from sidecar._src.tools import goodput_live
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit

# A life of pid 42: started at 0, first step at 10, a save at 50, its last mark at 60.
EVENTS = [Event("start", "42@0.0", 0.5, Counters(), start=0.0, pid=42),
          Event("first_step", "42@0.0", 10.0, Counters(2, 0.0, 0.0, 0.0)),
          Event("save", "42@0.0", 50.0, Counters(40, 0.0, 1.0, 0.0), step=40),
          Event("mark", "42@0.0", 60.0, Counters(50, 0.0, 1.0, 0.0))]


def trainer(**kw):
  return pb.TrainerStatus(**{"pid": 42, "pid_verified": True, "rank": 0, "restart": 0,
                             "stall_timeout_s": 20.0, **kw})


def gap(*trainers):
  ledger = accounting.account(EVENTS)
  return goodput_live.open_gap(EVENTS, ledger.lives[-1], trainers, now=100.0)


def test_a_hang_past_its_timeout_is_stall_from_its_last_step():
  g = gap(trainer(stalled=True, since_step_s=35.0, last_step_unix=65.0))
  ledger = accounting.account([*EVENTS, *g.events])
  assert ledger.wall_s == 100.0 and ledger.badput_s["stall"] == pytest.approx(35.0)
  assert g.said == ("life 42@0.0 is stalled: no step for 35.0 s, past its stall timeout of "
                    "20.0 s: counted as stall since its last step")


def test_a_gap_within_its_timeout_is_step_time_to_now():
  g = gap(trainer(since_step_s=5.0, last_step_unix=95.0))
  ledger = accounting.account([*EVENTS, *g.events])
  assert ledger.wall_s == 100.0 and ledger.badput_s["stall"] == 0.0
  assert g.said == ("life 42@0.0 is running, its last step 5.0 s ago (its stall timeout "
                    "20.0 s): counted to now")


def test_an_open_phase_is_counted_as_that_phase():
  g = gap(trainer(phase="eval", phase_s=30.0, since_step_s=30.0, last_step_unix=70.0))
  ledger = accounting.account([*EVENTS, *g.events])
  assert ledger.wall_s == 100.0 and ledger.badput_s["phase"] == pytest.approx(30.0)
  assert g.said == "life 42@0.0 is in phase 'eval' for 30.0 s: counted as that phase"


@pytest.mark.parametrize("kw", [dict(pid=43), dict(pid_verified=False), dict(ended=True)],
                         ids=["another-pid", "unverified", "ended"])
def test_a_life_no_sidecar_lists_is_counted_as_its_file_has_it_and_said(kw):
  g = gap(trainer(stalled=True, since_step_s=35.0, last_step_unix=65.0, **kw))
  assert g.events == ()
  assert g.said.startswith("life 42@0.0 is still running, or its sidecar is gone: counted "
                           "up to its last event, 40.0 s ago (name its sidecars' addresses")
