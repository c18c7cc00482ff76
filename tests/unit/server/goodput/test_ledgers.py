"""The sidecar's goodput ledgers (server/goodput/ledgers.py): files, checks, deaths.

Tier 1: a Ledgers with a resolver of its own (no server, no sockets), writing in tmp_path.
"""

import os

import pytest

from sidecar._src.core import errors, goodput as goodput_core
from sidecar._src.server.goodput import ledgers as ledgers_lib

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
  out = ledgers_lib.Ledgers(resolve, clock=lambda: 99.0)
  yield out
  out.close()


def test_events_are_appended_to_the_file_the_sidecar_derives(ledgers, tmp_path):
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  ledgers.receive("w-1", {"events": [event("save", step=5, t=3.0)]}, tenant=None)
  events = goodput_core.read(str(tmp_path))
  assert [e.kind for e in events] == ["start", "save"]
  ledgers.ended("w-1")  # no finish: the process died now
  assert goodput_core.read(str(tmp_path))[-1] == goodput_core.Event("died", "7@1.000", 99.0)
  [figures] = ledgers.figures()
  assert figures.directory == str(tmp_path) and figures.ledger.lives[0].ended == "died"


def test_a_death_carries_when_the_process_was_last_heard_from(ledgers, tmp_path):
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  ledgers.ended("w-1", 97.5)
  assert goodput_core.read(str(tmp_path))[-1] == goodput_core.Event("died", "7@1.000", 99.0,
                                                                    seen=97.5)


def test_a_finished_session_ends_without_a_death(ledgers, tmp_path):
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7), event("finish")]},
                 tenant=None)
  ledgers.ended("w-1")
  assert [e.kind for e in goodput_core.read(str(tmp_path))] == ["start", "finish"]


def test_a_stopping_sidecar_writes_no_death(ledgers, tmp_path):
  ledgers.receive("w-1", {"directory": str(tmp_path), "events": [event("mark")]}, tenant=None)
  ledgers.close()
  ledgers.ended("w-1")
  assert [e.kind for e in goodput_core.read(str(tmp_path))] == ["mark"]


def test_a_new_session_reads_the_previous_lives_from_the_file(ledgers, tmp_path):
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  ledgers.ended("w-1")
  again = ledgers_lib.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 200.0)
  again.receive("w-2", {"directory": str(tmp_path),
                       "events": [event("start", life="8@150.000", t=151.0, start=150.0)]},
               tenant=None)
  assert again.figures()[0].ledger.restarts == 1
  again.ended("w-2")


@pytest.mark.parametrize("message, tenant, error, match", [
    ({"events": [event("mark")]}, None, errors.InvalidArgumentError, "no ledger is bound"),
    ({"directory": "/etc", "events": []}, None, errors.PermissionDeniedError, "not yours"),
    ({"directory": "HERE", "events": []}, "intruder", errors.PermissionDeniedError, "not yours"),
    ({"directory": 5}, None, errors.InvalidArgumentError, "directory must be a path"),
    ({"directory": "HERE", "events": [{"kind": "died", "life": "a", "t": 1.0}]}, None,
     errors.InvalidArgumentError, "the sidecar's to write"),
    ({"directory": "HERE", "events": [event("mark")] * (ledgers_lib.MAX_EVENTS + 1)}, None,
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
    ledgers.receive("w-1", message, tenant=tenant)
  assert not os.path.exists(goodput_core.path_in(str(tmp_path))) or not goodput_core.read(
      str(tmp_path))


def test_one_session_binds_once_and_records_one_life(ledgers, tmp_path):
  ledgers.receive("w-1", {"directory": str(tmp_path), "events": [event("mark")]}, tenant=None)
  with pytest.raises(errors.InvalidArgumentError, match="bound to"):
    ledgers.receive("w-1", {"directory": str(tmp_path), "events": []}, tenant=None)
  with pytest.raises(errors.InvalidArgumentError, match="one process life"):
    ledgers.receive("w-1", {"events": [event("mark", life="9@1.000")]}, tenant=None)
  ledgers.ended("w-1")


def test_marks_are_coalesced_in_memory_and_on_disk(tmp_path):
  now = [0.0]
  ledgers = ledgers_lib.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 99.0,
                            monotonic=lambda: now[0])
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("mark", t=float(t)) for t in range(10)]},
                 tenant=None)
  # A trainer marking every step: 560 frames of 256 marks write one line, not 143,360.
  for _ in range(560):
    now[0] += 0.001
    ledgers.receive("w-1", {"events": [event("mark", t=50.0)] * 256}, tenant=None)
  assert [e.t for e in goodput_core.read(str(tmp_path))] == [9.0]
  now[0] += ledgers_lib.MARK_EVERY_S
  ledgers.receive("w-1", {"events": [event("mark", t=60.0)]}, tenant=None)  # due: written
  ledgers.receive("w-1", {"events": [event("mark", t=61.0)]}, tenant=None)  # held
  ledgers.receive("w-1", {"events": [event("save", t=62.0, step=3)]}, tenant=None)
  assert [(e.kind, e.t) for e in goodput_core.read(str(tmp_path))] == [
      ("mark", 9.0), ("mark", 60.0), ("mark", 61.0), ("save", 62.0)]
  ledgers.receive("w-1", {"events": [event("mark", t=63.0)]}, tenant=None)  # held,
  ledgers.ended("w-1")  # then written before the death
  assert [(e.kind, e.t) for e in goodput_core.read(str(tmp_path))][-2:] == [
      ("mark", 63.0), ("died", 99.0)]
  assert len(ledgers._jobs[None][str(tmp_path)]) == 4  # the marks replace each other


# ---- issue 63.2: a ledger per tenant, bounded --------------------------------------------

def test_each_tenant_s_ledger_is_its_own_in_the_figures(tmp_path):
  ledgers = ledgers_lib.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 99.0)
  (tmp_path / "alice").mkdir()
  (tmp_path / "bob").mkdir()
  ledgers.receive("w-a", {"directory": str(tmp_path / "alice"), "events": [
      event("start", life="1@1.000", t=2.0, start=1.0, pid=1),
      event("finish", life="1@1.000", t=50.0)]}, tenant="alice")
  ledgers.receive("w-b", {"directory": str(tmp_path / "bob"), "events": [
      event("start", life="2@1.000", t=2.0, start=1.0, pid=2)]}, tenant="bob")
  figures = {(f.tenant, f.directory): f.ledger for f in ledgers.figures()}
  assert figures[("alice", str(tmp_path / "alice"))].wall_s == 49.0
  assert figures[("bob", str(tmp_path / "bob"))].lives[0].ended == "running"
  ledgers.ended("w-a")
  ledgers.ended("w-b")


def test_a_tenant_keeps_its_latest_ledgers_only(tmp_path):
  ledgers = ledgers_lib.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 99.0)
  ledgers.receive("w-a", {"directory": str(tmp_path), "events": [event("mark")]},
                 tenant="alice")
  for i in range(ledgers_lib.MAX_JOBS + 3):
    (tmp_path / f"b{i}").mkdir()
    ledgers.receive(f"w-b{i}", {"directory": str(tmp_path / f"b{i}"), "events": [
        event("mark")]}, tenant="bob")
  by_tenant = [f.tenant for f in ledgers.figures()]
  assert by_tenant.count("bob") == ledgers_lib.MAX_JOBS and by_tenant.count("alice") == 1
  for session in ["w-a", *(f"w-b{i}" for i in range(ledgers_lib.MAX_JOBS + 3))]:
    ledgers.ended(session)


@pytest.mark.parametrize("bad, match", [
    (dict(t=99.0 + 3_600_000), "after this sidecar's clock"),
    (dict(t=1.0), "before this sidecar's clock"),
    (dict(kind="start", t=60.0, start=60.0 - ledgers_lib.MAX_STARTUP_S - 100), "process start"),
    (dict(kind="start", t=60.0, start=99.0 + 1000), "process start"),
    (dict(t=60.0, counters=3_600_000.0), "more than its process has lived"),
], ids=["future", "before-attach", "start-hours-before", "start-in-the-future", "counters"])
def test_a_frame_off_the_sidecar_s_clock_is_refused(tmp_path, bad, match):
  ledgers = ledgers_lib.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 99.0)
  kind = bad.pop("kind", "mark")
  blocked = bad.pop("counters", 0.0)
  frame = goodput_core.Event(kind, "7@40.000", bad.pop("t"),
                             goodput_core.Counters(0, blocked, 0.0, 0.0), **bad,
                             **({"pid": 7} if kind == "start" else {})).to_dict()
  start = event("start", life="7@40.000", t=50.0, start=40.0, pid=7)
  with pytest.raises(errors.InvalidArgumentError, match=match):
    ledgers.receive("w-1", {"directory": str(tmp_path), "events": [start, frame]},
                   tenant=None, attached=45.0)
  assert not os.path.exists(goodput_core.path_in(str(tmp_path)))
  ledgers.receive("w-1", {"directory": str(tmp_path), "events": [start]}, tenant=None,
                 attached=45.0)
  ledgers.ended("w-1")


def test_appends_past_the_rate_are_refused(tmp_path):
  now = [0.0]
  ledgers = ledgers_lib.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 99.0,
                            monotonic=lambda: now[0])
  ledgers.receive("w-1", {"directory": str(tmp_path), "events": []}, tenant=None)
  saves = [event("save", t=50.0, step=i) for i in range(ledgers_lib.MAX_EVENTS)]
  with pytest.raises(errors.ResourceExhaustedError, match="faster than"):
    for _ in range(100):
      ledgers.receive("w-1", {"events": saves}, tenant=None)
  size = os.path.getsize(goodput_core.path_in(str(tmp_path)))
  assert size <= ledgers_lib.BURST_BYTES
  now[0] += 100.0  # the bucket refills
  ledgers.receive("w-1", {"events": saves[:1]}, tenant=None)
  ledgers.ended("w-1")


def test_a_new_session_per_frame_shares_its_tenant_s_bucket(tmp_path):
  """Issue 70, item 6: one worker session per 63 KiB frame wrote 2.9-6.2 MiB/s, each
  session a bucket of its own; a tenant's sessions now share one, their ends' deaths
  included (owed, and nothing more goes until it is paid), and another tenant's is its own."""
  now = [0.0]
  ledgers = ledgers_lib.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 99.0,
                                monotonic=lambda: now[0])
  (tmp_path / "bob").mkdir()
  (tmp_path / "alice").mkdir()
  saves = [event("save", t=50.0, step=i) for i in range(ledgers_lib.MAX_EVENTS)]
  refused = 0
  for i in range(40):
    try:
      ledgers.receive(f"bob-{i}", {"directory": str(tmp_path / "bob"),
                                   "events": [event("start", start=1.0, pid=7), *saves[1:]]},
                      tenant="bob")
    except errors.ResourceExhaustedError as e:
      assert "tenant 'bob'" in str(e) and "together" in str(e)
      refused += 1
    ledgers.ended(f"bob-{i}")  # its death is written, owed past the bucket
    now[0] += 0.01
  assert refused >= 35
  size = os.path.getsize(goodput_core.path_in(str(tmp_path / "bob")))
  assert size <= ledgers_lib.BURST_BYTES + 40 * 200 + ledgers_lib.RATE_BYTES_S
  # alice's ledger is not held to bob's budget.
  ledgers.receive("alice-0", {"directory": str(tmp_path / "alice"), "events": saves[:64]},
                  tenant="alice")
  ledgers.ended("alice-0")


def test_appends_count_against_the_storage_quota_before_they_are_written(tmp_path):
  asked = []

  def check(tenant, directory, nbytes):
    asked.append((tenant, nbytes))
    if nbytes > 200:
      raise errors.ResourceExhaustedError(f"{nbytes} more would pass its quota")
  ledgers = ledgers_lib.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 99.0,
                            check_storage=check)
  ledgers.receive("w-1", {"directory": str(tmp_path), "events": [event("save", step=1)]},
                 tenant="bob")
  with pytest.raises(errors.ResourceExhaustedError, match="would pass its quota"):
    ledgers.receive("w-1", {"events": [event("save", step=i) for i in range(5)]},
                   tenant="bob")
  assert len(goodput_core.read(str(tmp_path))) == 1
  assert asked[0][0] == "bob"
  ledgers.ended("w-1")


def test_an_append_after_a_torn_line_starts_on_a_fresh_line(ledgers, tmp_path):
  # A sidecar killed mid-append left half a line; the next one's events all count.
  whole = goodput_core.Event("start", "7@1.000", 2.0, goodput_core.Counters(), start=1.0,
                             pid=7)
  (tmp_path / goodput_core.FILE).write_bytes(whole.line() + whole.line()[:25])
  ledgers.receive("w-1", {"directory": str(tmp_path), "events": [
      event("finish", life="7@1.000", t=50.0)]}, tenant=None)
  reading = goodput_core.read_all(str(tmp_path))
  assert [e.kind for e in reading.events] == ["start", "finish"] and reading.skipped == 1
  ledgers.ended("w-1")


def test_a_stalled_session_s_death_says_so(ledgers, tmp_path):
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  ledgers.ended("w-1", 90.0, stalled=80.0)
  died = goodput_core.read(str(tmp_path))[-1]
  assert (died.kind, died.seen, died.stalled) == ("died", 90.0, 80.0)


def test_each_tenant_s_bound_is_its_own_and_a_reload_s_holds_at_once(tmp_path):
  """A pool file's ledger_bytes_per_s and ledger_burst_bytes (``Ledgers(bound=...)``)
  bound each tenant's appends; a changed bound holds from the next frame."""
  now = [0.0]
  bounds = {"bob": ledgers_lib.Bound(burst=8 << 10, rate=1 << 10, why="bob's line"),
            "alice": ledgers_lib.Bound(burst=1 << 20, rate=1 << 10, why="alice's line")}
  ledgers = ledgers_lib.Ledgers(lambda d, t: os.path.realpath(d), clock=lambda: 99.0,
                                monotonic=lambda: now[0], bound=bounds.__getitem__)
  for name in bounds:
    (tmp_path / name).mkdir()
  saves = [event("save", t=50.0, step=i) for i in range(ledgers_lib.MAX_EVENTS)]
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"faster than 1024 bytes/s together \(bursts of 8192; bob's line\)"):
    ledgers.receive("bob-0", {"directory": str(tmp_path / "bob"), "events": saves},
                    tenant="bob")
  ledgers.receive("alice-0", {"directory": str(tmp_path / "alice"), "events": []},
                  tenant="alice")
  for _ in range(8):  # 8 x ~25 KiB, past the default's 64 KiB at once
    ledgers.receive("alice-0", {"events": saves}, tenant="alice")
  bounds["alice"] = ledgers_lib.Bound(burst=4 << 10, rate=1 << 10, why="reloaded")
  with pytest.raises(errors.ResourceExhaustedError, match="reloaded"):
    ledgers.receive("alice-0", {"events": saves}, tenant="alice")
  ledgers.ended("alice-0")
  ledgers.ended("bob-0")


def test_a_stall_reported_of_another_trainer_of_its_start_is_its_death_s(ledgers, tmp_path):
  """Issue 69: rank k stalled and was killed (sidecar launch's Stalled report); process 0,
  not stalled itself, dies next: its death is the stall's, from rank k's last step."""
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  assert not ledgers.stalled("w-2", 80.0, 90.0)  # no ledger bound to it here
  assert ledgers.stalled("w-1", 80.0, 90.0)
  ledgers.ended("w-1", 85.0)  # process 0 itself last heard from before the report
  died = goodput_core.read(str(tmp_path))[-1]
  assert (died.kind, died.seen, died.stalled) == ("died", 90.0, 80.0)
  [figures] = ledgers.figures()
  assert figures.ledger.badput_s["stall"] == 10.0


@pytest.mark.parametrize("then", [
    event("save", step=4, t=91.0),
    {**event("mark", t=91.0), "batches": 3},
], ids=["a-save", "more-batches"])
def test_a_life_that_steps_after_a_stall_report_did_not_die_of_it(ledgers, tmp_path, then):
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  assert ledgers.stalled("w-1", 80.0, 90.0)
  ledgers.receive("w-1", {"events": [then]}, tenant=None)
  ledgers.ended("w-1", 95.0)
  died = goodput_core.read(str(tmp_path))[-1]
  assert (died.kind, died.seen, died.stalled) == ("died", 95.0, None)


def test_its_own_stall_and_a_reported_one_the_earlier_last_step_counts(ledgers, tmp_path):
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  assert ledgers.stalled("w-1", 80.0, 90.0)
  ledgers.ended("w-1", 92.0, stalled=82.0)
  died = goodput_core.read(str(tmp_path))[-1]
  assert (died.seen, died.stalled) == (92.0, 80.0)


def test_a_finished_life_is_not_marked_by_a_stall_report(ledgers, tmp_path):
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7), event("finish")]},
                 tenant=None)
  assert not ledgers.stalled("w-1", 80.0, 90.0)
  ledgers.ended("w-1")
  assert [e.kind for e in goodput_core.read(str(tmp_path))] == ["start", "finish"]


def test_a_phase_and_a_slow_span_are_written_to_a_bound_ledger_only(ledgers, tmp_path):
  """Issue 77: what the stall rule saw between steps (``steps.py``'s ``on_gap``)."""
  ledgers.gap("w-none", "slow", None, 10.0, 20.0)  # no ledger bound: nothing, no error
  ledgers.receive("w-1", {"directory": str(tmp_path),
                         "events": [event("start", start=1.0, pid=7)]}, tenant=None)
  ledgers.gap("w-1", "phase", "eval", 20.0, 30.0)
  ledgers.gap("w-1", "slow", None, 40.0, 48.0)
  got = goodput_core.read(str(tmp_path))[1:]
  assert [(e.kind, e.name, e.begin, e.t) for e in got] == [
      ("phase", "eval", 20.0, 30.0), ("slow", None, 40.0, 48.0)]


def test_spans_past_the_bound_are_dropped_not_raised(tmp_path, caplog):
  out = ledgers_lib.Ledgers(lambda d, t: d, bound=lambda t: ledgers_lib.Bound(200, 1))
  out.receive("w-1", {"directory": str(tmp_path), "events": [event("start", start=1.0, pid=7)]},
              tenant=None)
  for i in range(50):  # a trainer that flips phases without end
    out.gap("w-1", "phase", "eval", 2.0 + i, 2.5 + i)
  written = [e for e in goodput_core.read(str(tmp_path)) if e.kind == "phase"]
  assert 0 < len(written) < 5
  assert caplog.text.count("not written") == 1
  out.close()
