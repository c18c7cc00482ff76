"""The threads that finish a process's saves (controller/checkpoint/finishers.py)."""

import os
import threading

import pytest

from sidecar._src.controller.checkpoint import finishers as finishers_lib
from tests.conftest import eventually

pytestmark = pytest.mark.unit


def test_a_finisher_thread_runs_one_save_at_a_time_and_ends_when_idle():
  finishers = finishers_lib.Finishers(idle_s=0.2)
  go, ran = threading.Event(), []

  def finish(name):
    ran.append(threading.current_thread().name)
    if name == "first":
      go.wait(10)

  first = finishers.submit(lambda: finish("first"), name="sidecar-save-1")
  second = finishers.submit(lambda: finish("second"), name="sidecar-save-2")  # another thread
  second.join(10)
  assert not second.is_alive() and first.is_alive()  # the first one's end does not hold it
  go.set()
  first.join(10)
  assert sorted(ran) == ["sidecar-save-1", "sidecar-save-2"]
  assert eventually(lambda: not [t for t in threading.enumerate()
                                 if t.name == finishers_lib.Finishers.IDLE_NAME and t.ident in
                                 {first.thread.ident, second.thread.ident}], timeout=5)


def test_a_finisher_that_raises_is_said_and_its_thread_serves_on(monkeypatch):
  said = []
  monkeypatch.setattr(threading, "excepthook", said.append)
  finishers = finishers_lib.Finishers(idle_s=5)
  failed = finishers.submit(lambda: 1 / 0, name="sidecar-save-7")
  failed.join(10)
  assert [type(a.exc_value) for a in said] == [ZeroDivisionError]
  assert said[0].thread is failed.thread and not failed.is_alive()
  after = finishers.submit(lambda: None, name="sidecar-save-8")
  after.join(10)
  assert after.thread is failed.thread


def test_a_forked_child_runs_its_finishers_on_threads_of_its_own():
  """The parent's idle finisher threads are not in a child it forks: a save there would
  have been promised to one of them, and waited forever."""
  finishers_lib.FINISHERS.submit(lambda: None, name="sidecar-save-0").join(10)  # one idle here
  pid = os.fork()
  if pid == 0:  # the child: exits at once, whatever happens
    done = finishers_lib.FINISHERS.submit(lambda: None, name="sidecar-save-1")
    done.join(10)
    os._exit(0 if not done.is_alive() else 1)
  _, status = os.waitpid(pid, 0)
  assert os.waitstatus_to_exitcode(status) == 0
