"""A step's commit on storage and its abort, one at a time (``commit_gate.CommitGate``), as
``save.StepWriter`` drives them: an abort waits for a commit under way and is told where it
committed the step; a commit after an abort is refused by name. No server, no files."""

import threading

import pytest

from sidecar._src.core import errors
from sidecar._src.server.checkpoint.commit_gate import CommitGate
from tests.conftest import eventually

pytestmark = pytest.mark.unit

FINAL = "/ck/run/1/default"


def test_an_abort_waits_for_a_commit_under_way_and_is_told_where_it_committed():
  gate = CommitGate(1, FINAL)
  gate.begin()
  with pytest.raises(errors.DeadlineExceededError, match="still being committed after 0 s"):
    gate.abort(0)
  answer: list[str] = []
  aborting = threading.Thread(target=lambda: answer.append(gate.abort(10)))
  aborting.start()
  assert not eventually(lambda: bool(answer), 0.2)  # it waits for the commit's end
  gate.end("/ck/run/1")
  aborting.join(10)
  assert answer == ["/ck/run/1"]  # committed: the abort removes nothing of it
  assert gate.abort(0) == "/ck/run/1"  # and so is any abort after
  with pytest.raises(errors.PermissionDeniedError, match="is being committed already or was"):
    gate.begin()


def test_a_commit_of_an_aborted_step_is_refused_by_name_and_a_failed_one_is_aborted():
  gate = CommitGate(1, FINAL)
  assert gate.abort(0) == ""  # no commit began: aborted
  with pytest.raises(errors.ClosedError, match=f"the save of step 1 at '{FINAL}' was aborted "
                     "by its trainers before its commit began: it is not committed"):
    gate.begin()
  failed = CommitGate(1, FINAL)
  failed.begin()
  failed.end()  # it failed: nothing committed
  assert failed.abort(0) == ""  # aborted, its files go
