"""The sidecar's goodput ledgers (server/goodput.py): files, checks, deaths.

Tier 1: a Ledgers with a resolver of its own (no server, no sockets), writing in tmp_path.
"""

import os

import pytest

from sidecar._src.core import errors, goodput as goodput_core
from sidecar._src.server import goodput

pytestmark = pytest.mark.unit


def event(kind, life="7@1.000", t=2.0, **kw):
  return goodput_core.Event(kind, life, t, goodput_core.Counters(), **kw).to_dict()


@pytest.fixture
def ledgers(tmp_path):
  root = str(tmp_path)

  def resolve(directory, tenant):
    resolved = os.path.realpath(directory)
    if not resolved.startswith(root) or tenant == "intruder":
      raise errors.PermissionDeniedError(f"{directory} is not yours")
    return resolved
  out = goodput.Ledgers(resolve, clock=lambda: 99.0)
  yield out
  out.close()


def test_events_are_appended_to_the_file_the_sidecar_derives(ledgers, tmp_path):
  ledgers.record("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  ledgers.record("w-1", {"events": [event("save", step=5, t=3.0)]}, tenant=None)
  events = goodput_core.read(str(tmp_path))
  assert [e.kind for e in events] == ["start", "save"]
  ledgers.ended("w-1")  # no finish: the process died now
  assert goodput_core.read(str(tmp_path))[-1] == goodput_core.Event("died", "7@1.000", 99.0)
  directory, ledger = ledgers.figures()
  assert directory == str(tmp_path) and ledger.lives[0].ended == "died"


def test_a_death_carries_when_the_process_was_last_heard_from(ledgers, tmp_path):
  ledgers.record("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  ledgers.ended("w-1", 97.5)
  assert goodput_core.read(str(tmp_path))[-1] == goodput_core.Event("died", "7@1.000", 99.0,
                                                                    seen=97.5)


def test_a_finished_session_ends_without_a_death(ledgers, tmp_path):
  ledgers.record("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7), event("finish")]},
                 tenant=None)
  ledgers.ended("w-1")
  assert [e.kind for e in goodput_core.read(str(tmp_path))] == ["start", "finish"]


def test_a_stopping_sidecar_writes_no_death(ledgers, tmp_path):
  ledgers.record("w-1", {"directory": str(tmp_path), "events": [event("mark")]}, tenant=None)
  ledgers.close()
  ledgers.ended("w-1")
  assert [e.kind for e in goodput_core.read(str(tmp_path))] == ["mark"]


def test_a_new_session_reads_the_previous_lives_from_the_file(ledgers, tmp_path):
  ledgers.record("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  ledgers.ended("w-1")
  again = goodput.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 200.0)
  again.record("w-2", {"directory": str(tmp_path),
                       "events": [event("start", life="8@150.000", t=151.0, start=150.0)]},
               tenant=None)
  assert again.figures()[1].restarts == 1
  again.ended("w-2")


@pytest.mark.parametrize("message, tenant, error, match", [
    ({"events": [event("mark")]}, None, errors.InvalidArgumentError, "no ledger is bound"),
    ({"directory": "/etc", "events": []}, None, errors.PermissionDeniedError, "not yours"),
    ({"directory": "HERE", "events": []}, "intruder", errors.PermissionDeniedError, "not yours"),
    ({"directory": 5}, None, errors.InvalidArgumentError, "directory must be a path"),
    ({"directory": "HERE", "events": [{"kind": "died", "life": "a", "t": 1.0}]}, None,
     errors.InvalidArgumentError, "the sidecar's to write"),
    ({"directory": "HERE", "events": [event("mark")] * (goodput.MAX_EVENTS + 1)}, None,
     errors.InvalidArgumentError, "at most 256"),
    ({"directory": "HERE", "events": [dict(event("mark"), life="x" * 300)]}, None,
     errors.InvalidArgumentError, "life must be a name"),
], ids=["unbound", "outside-roots", "another-tenant", "not-a-path", "forged-death",
        "too-many", "huge-life"])
def test_a_bad_frame_is_refused_and_writes_nothing(ledgers, tmp_path, message, tenant, error,
                                                   match):
  if message.get("directory") == "HERE":
    message = dict(message, directory=str(tmp_path))
  with pytest.raises(error, match=match):
    ledgers.record("w-1", message, tenant=tenant)
  assert not os.path.exists(goodput_core.path_in(str(tmp_path))) or not goodput_core.read(
      str(tmp_path))


def test_one_session_binds_once_and_records_one_life(ledgers, tmp_path):
  ledgers.record("w-1", {"directory": str(tmp_path), "events": [event("mark")]}, tenant=None)
  with pytest.raises(errors.InvalidArgumentError, match="bound to"):
    ledgers.record("w-1", {"directory": str(tmp_path), "events": []}, tenant=None)
  with pytest.raises(errors.InvalidArgumentError, match="one process life"):
    ledgers.record("w-1", {"events": [event("mark", life="9@1.000")]}, tenant=None)
  ledgers.ended("w-1")


def test_marks_replace_each_other_in_memory_but_not_on_disk(ledgers, tmp_path):
  ledgers.record("w-1", {"directory": str(tmp_path),
                         "events": [event("mark", t=float(t)) for t in range(10)]},
                 tenant=None)
  assert len(goodput_core.read(str(tmp_path))) == 10
  assert len(ledgers._events) == 1
  ledgers.ended("w-1")
