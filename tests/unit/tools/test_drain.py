"""How a launch waits for the steps its sidecars accepted (tools/drain.py), against sidecars
faked at the one seam, ``poll``; real launches stopped mid-write are in
tests/processes/tools/test_launch_stop.py."""

import pytest

from sidecar._src.core import errors
from sidecar._src.tools import drain

pytestmark = pytest.mark.unit
W, U, C = drain.WRITING, drain.UNCOMMITTED, drain.COMMITTED


class Sidecars:
  """Each host's answers to successive polls (its last one repeats); an exception is a
  sidecar that does not answer."""

  def __init__(self, answers):
    self.answers = {h: list(a) for h, a in answers.items()}
    self.polls = 0

  def poll(self, host, address, timeout):
    assert address == f"unix:/h{host}" and timeout > 0
    self.polls += 1
    queue = self.answers[host]
    answer = queue.pop(0) if len(queue) > 1 else queue[0]
    if isinstance(answer, Exception):
      raise answer
    return {drain.SidecarStep(step, host, "/ckpt"): state for step, state in answer.items()}


def _wait(answers, *, grace=30.0, interrupted=lambda: None, committed=lambda step: False):
  """The steps abandoned once the sidecars stopped (``committed``: what their directory
  shows then), and what was said."""
  said = []
  sidecars = Sidecars(answers)
  drained = drain.wait({h: f"unix:/h{h}" for h in answers}, grace=grace, say=said.append,
                       interrupted=interrupted, poll=sidecars.poll)
  abandoned = drain.settle(drained, said.append, committed=committed)
  return [(s.step, s.host) for s in abandoned], said


def test_nothing_being_written_is_one_poll_and_no_word():
  abandoned, said = _wait({0: [{100: C}], 1: [{}]})
  assert abandoned == [] and said == []


def test_the_steps_being_written_are_waited_for_until_committed():
  abandoned, said = _wait({0: [{200: W}, {200: W}, {200: U}, {200: C}], 1: [{200: W}, {200: C}]})
  assert abandoned == []
  assert said[0] == ("waiting up to 30 s for step 200 on hosts 0, 1 to be written (Ctrl-C "
                     "to stop now, abandoning them)")
  assert said[1].startswith("step 200 on hosts 0, 1 written and committed ") and len(said) == 2


def test_the_grace_running_out_names_what_is_abandoned():
  abandoned, said = _wait({0: [{300: W, 200: C}]}, grace=0.3)
  assert abandoned == [(300, 0)]
  assert said[-2].startswith("still being written after 0.3 s: step 300 on host 0 still being "
                             "written; the sidecars stop now")
  assert said[-1] == "still being written after 0.3 s: abandoned step 300 on host 0 (not committed)"


def test_a_step_the_sidecar_commits_as_it_stops_is_said_committed_not_abandoned():
  """Issue 69: ``--save-grace 0`` after Ctrl-C said "abandoned step 200 (not committed)"
  while the sidecar, given its stop's grace, committed step 200 (a re-run restored it)."""
  abandoned, said = _wait({0: [{200: W}]}, grace=0.0, committed=lambda s: s.step == 200)
  assert abandoned == []
  assert said[-1] == ("still being written after 0 s: step 200 on host 0 committed as the "
                      "sidecars stopped")
  assert not any("abandoned" in line for line in said), said


def test_a_signal_ends_the_wait_at_once():
  signals = iter([None, "SIGINT"])
  abandoned, said = _wait({0: [{300: W}]}, interrupted=lambda: next(signals))
  assert abandoned == [(300, 0)]
  assert said[-1] == "got SIGINT while waiting: abandoned step 300 on host 0 (not committed)"


def test_a_step_written_and_never_committed_is_abandoned_after_a_moment():
  abandoned, said = _wait({0: [{400: W}, {400: U}]})
  assert abandoned == [(400, 0)]
  assert said[-1].startswith("abandoned step 400 on host 0: not committed (no trainer is left")


def test_a_step_left_uncommitted_before_the_stop_is_named_without_a_wait():
  abandoned, said = _wait({0: [{500: U, 400: C}], 1: [{}]})
  assert abandoned == [(500, 0)] and len(said) == 1 and "waiting" not in said[0]


def test_a_sidecar_that_stops_answering_abandons_its_steps_and_the_others_go_on():
  gone = errors.HostLostError("the sidecar is gone", host_id=1)
  abandoned, said = _wait({0: [{600: W}, {600: C}], 1: [{600: W}, gone]})
  assert abandoned == [(600, 1)]
  assert any(line.startswith("host 1's sidecar did not say which steps it is writing: ")
             for line in said), said
  assert "step 600 on host 0 written and committed" in "\n".join(said)
  assert "abandoned step 600 on host 1: its sidecar stopped answering" in said


def test_steps_of_several_directories_are_named_with_them():
  step = drain.SidecarStep
  assert drain._steps([step(1, 0, "/a"), step(2, 0, "/b"), step(1, 1, "/a")]) == (
      "step 1 of /a on hosts 0, 1; step 2 of /b on host 0")


def test_a_job_that_stopped_with_steps_saved_says_how_to_resume(tmp_path):
  """Issue 69 (and 71): a stopped job names the step a re-run of the same command resumes
  from: the newest one committed in its directory, never one left half written."""
  said = []
  ckpt = tmp_path / "ckpt"
  for step in (100, 200):
    (ckpt / str(step)).mkdir(parents=True)
    (ckpt / str(step) / "_CHECKPOINT_METADATA").write_text("{}")
  (ckpt / "300.orbax-checkpoint-tmp").mkdir()
  (ckpt / "400").mkdir()  # no metadata: never committed
  drained = drain.Drained(directories=frozenset({str(ckpt), str(tmp_path / "gone")}))
  drain.after_stop(drained, 130, said.append)
  assert said == ["re-run the same command to resume from step 200"]
  said.clear()
  drain.after_stop(drained, 0, said.append)  # it ended well: nothing to resume
  assert said == []
  drain.after_stop(drain.Drained(), 1, said.append)  # it saved nothing
  assert said == []


def test_a_job_whose_sidecar_died_or_whose_failure_recurs_says_how_to_resume(tmp_path):
  """Issue 79 item 5: a killed sidecar said nothing at the end, so no re-run line came;
  after "a restart would fail again" the line still said to re-run as it was."""
  said = []
  ckpt = tmp_path / "ckpt"
  (ckpt / "100").mkdir(parents=True)
  (ckpt / "100" / "_CHECKPOINT_METADATA").write_text("{}")
  drain.after_stop(drain.Drained(), 1, said.append, seen={str(ckpt)})  # seen while it ran
  assert said == ["re-run the same command to resume from step 100"]
  said.clear()
  drain.after_stop(drain.Drained(), 1, said.append, seen={str(ckpt)}, fails_again=True)
  assert said == ["once what failed is fixed, re-run the same command to resume from step "
                  "100 (as it is, it would fail the same way again)"]
