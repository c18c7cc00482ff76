"""Tier 1: which step a restore returns when the one asked for is corrupt
(``controller/checkpoint/fallback.py``): the error names the older intact steps; with
``fallback=True`` the newest step that restores whole, agreed by every process."""

import logging
import threading

import pytest

from sidecar._src.controller.checkpoint import fallback
from sidecar._src.controller.peers import LocalPeers
from sidecar._src.core import errors
from tests.support.fake_sidecars import DictPeers

pytestmark = pytest.mark.unit


def _attempts(corrupt=(), other=()):
  tried = []

  def attempt(step):
    tried.append(step)
    if step in corrupt:
      raise errors.CorruptCheckpointError(f"step {step}: default/w/.zarray says dtype int32\n"
                                          "more lines")
    if step in other:
      raise errors.ResourceExhaustedError(f"no room for step {step}")
    return {"step": step}
  return attempt, tried


def _restore(steps, attempt, *, fallback_=True, intact=lambda s: True, peers=None):
  return fallback.restore(steps, attempt, fallback=fallback_, intact=intact,
                          peers=peers or LocalPeers(), key="k", directory="/ck")


def test_fallback_restores_the_newest_whole_step_and_says_what_it_skipped(caplog):
  attempt, tried = _attempts(corrupt={5, 4})
  with caplog.at_level(logging.WARNING):
    got = _restore([5, 4, 3, 2], attempt)
  assert (got.tree, got.step, tried) == ({"step": 3}, 3, [5, 4, 3])
  assert [(s.step, s.reason) for s in got.skipped] == [
      (5, "step 5: default/w/.zarray says dtype int32"),
      (4, "step 4: default/w/.zarray says dtype int32")]
  assert ("restored step 3 of /ck instead of step 5 (fallback=True): step 5 skipped: step 5: "
          "default/w/.zarray says dtype int32; step 4 skipped:") in caplog.text


def test_without_fallback_the_error_names_the_older_steps_that_check_intact():
  attempt, tried = _attempts(corrupt={5})
  with pytest.raises(errors.CorruptCheckpointError) as e:
    _restore([5, 4, 3], attempt, fallback_=False, intact=lambda s: s == 3)
  assert tried == [5]
  assert ("Step 5 of /ck is not restored as saved: older committed steps that check intact: "
          "[3]; restore one (restore(3, ...)), or pass fallback=True") in str(e.value)
  assert "latest_step() stays 5" in str(e.value)


def test_the_error_checks_a_bounded_number_of_older_steps():
  attempt, _ = _attempts(corrupt={100})
  asked = []
  with pytest.raises(errors.CorruptCheckpointError, match=r"\(and 12 older, not checked\)"):
    _restore(list(range(100, 79, -1)), attempt, fallback_=False,
             intact=lambda s: asked.append(s) or True)
  assert asked == list(range(99, 99 - fallback.MAX_CHECKED, -1))


def test_a_failure_that_is_not_the_steps_fault_is_raised_not_skipped():
  attempt, tried = _attempts(other={5})
  with pytest.raises(errors.ResourceExhaustedError, match="no room for step 5"):
    _restore([5, 4], attempt)
  assert tried == [5]


def test_no_step_restores_whole():
  attempt, _ = _attempts(corrupt={2, 1})
  with pytest.raises(errors.CorruptCheckpointError,
                     match=r"no committed step of /ck restores whole: step 2: .*; step 1: "):
    _restore([2, 1], attempt)


def test_every_process_skips_a_step_one_process_found_corrupt():
  """Process 1's shards of step 5 are corrupt, process 0's are not: both restore step 4."""
  store: dict = {}
  results: dict = {}

  def run(index):
    attempt, tried = _attempts(corrupt={5} if index == 1 else set())
    got = _restore([5, 4], attempt, peers=DictPeers(store, index, 2))
    results[index] = (got.step, tried, [s.step for s in got.skipped])

  threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert results == {0: (4, [5, 4], [5]), 1: (4, [5, 4], [5])}


@pytest.mark.parametrize("step, committed, match", [
    (None, [], "no committed step in /ck to restore"),
    (7, [3, 5], r"step 7 does not exist in /ck; committed steps: \[3, 5\]"),
    (7, [], "step 7 does not exist in /ck; committed steps: none"),
], ids=["none-committed", "not-committed", "not-committed-none"])
def test_a_restore_of_a_step_not_committed_is_refused_naming_the_committed(step, committed,
                                                                           match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    fallback.pick(step, committed, "/ck")


def test_a_restore_starts_from_the_step_asked_or_the_latest():
  assert fallback.pick(None, [3, 5, 9], "/ck") == 9
  assert fallback.pick(5, [3, 5, 9], "/ck") == 5


def test_process_0_lists_the_steps_every_process_tries_newest_first():
  assert fallback.steps_to_try(5, [1, 3, 5, 9], peers=LocalPeers(), key="k") == [5, 3, 1]
  store: dict = {}
  results: dict = {}

  def run(index):  # process 1 lists a step more (its view late): process 0's list holds
    committed = [1, 3, 5] if index == 0 else [1, 2, 3, 5]
    results[index] = fallback.steps_to_try(5, committed, peers=DictPeers(store, index, 2),
                                           key="k")

  threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert results == {0: [5, 3, 1], 1: [5, 3, 1]}
