"""The goodput ledger's events and their file (core/goodput.py): every event checked, what
only a sidecar may write refused from a trainer, and a reader that survives anything (a
torn line, a hostile one: skipped and counted, what the accounting then reports).

Tier 1: events made by hand, files in tmp_path. The accounting is test_accounting.py's.
"""

import json

import pytest

from sidecar._src.core import accounting, goodput
from sidecar._src.core.goodput import Counters, Event

pytestmark = pytest.mark.unit


def clean_life():
  """One life's events: started at 0, its first step at 1, step 5 saved at 5 (0.5 s of
  it blocked), finished at 10 (test_accounting.py's ``life("a", 0.0, first=1.0,
  saves=[(5.0, 5, 0.5)], end=10.0, ended="finish")``)."""
  return [Event("start", "a", 0.5, Counters(), start=0.0, pid=1),
          Event("first_step", "a", 1.0, Counters()),
          Event("save", "a", 5.0, Counters(0, 0.0, 0.5, 0.0), step=5),
          Event("finish", "a", 10.0, Counters())]


def test_the_file_round_trips_and_skips_a_torn_last_line(tmp_path):
  events = clean_life()
  data = b"".join(e.line() for e in events) + b'{"kind": "mark", "li'
  (tmp_path / goodput.FILE).write_bytes(data)
  assert goodput.read(str(tmp_path)) == events
  assert accounting.account(goodput.read(str(tmp_path))).to_dict()["wall_s"] == 10.0


@pytest.mark.parametrize("raw, match", [
    ({"kind": "nap", "life": "a", "t": 1.0}, "kind must be one of"),
    ({"kind": "mark", "life": "", "t": 1.0}, "life must be a name"),
    ({"kind": "mark", "life": "a", "t": float("nan")}, "t must be finite"),
    ({"kind": "save", "life": "a", "t": 1.0, "step": -1}, "step must be an int"),
    ({"kind": "mark", "life": "a", "t": 1.0, "data_s": -1}, "counters must be numbers"),
    ({"kind": "start", "life": "a", "t": 1.0}, "needs the process's start"),
    ([1, 2], "a JSON object"),
], ids=["kind", "life", "nan", "step", "counter", "start", "not-a-dict"])
def test_a_malformed_event_is_refused_naming_the_field(raw, match):
  with pytest.raises(ValueError, match=match):
    goodput.Event.from_dict(json.loads(json.dumps(raw)))


def test_a_trainer_may_not_send_a_death_nor_too_many_events():
  with pytest.raises(ValueError, match="the sidecar's to write"):
    goodput.check_events([{"kind": "died", "life": "a", "t": 1.0}], limit=4)
  with pytest.raises(ValueError, match="at most 1"):
    goodput.check_events([{"kind": "mark", "life": "a", "t": 1.0}] * 2, limit=1)


# ---- a reader that survives anything (issue 63.3) -------------------------------------

HOSTILE = [
    ("huge-int", b'{"kind":"save","life":"x","t":1.0,"step":' + b"9" * 400 + b"}"),
    ("huge-int-time", b'{"kind":"mark","life":"x","t":' + b"9" * 400 + b"}"),
    ("huge-int-counter", b'{"kind":"mark","life":"x","t":1.0,"data_s":' + b"9" * 400 + b"}"),
    ("deep-nesting", b"[" * 100_000 + b"]" * 100_000),
    ("deep-nesting-short", b'{"kind":"mark","life":"x","t":1.0,"step":' + b"[" * 1500
     + b"]" * 1500 + b"}"),
    ("nan", b'{"kind":"mark","life":"x","t":NaN}'),
    ("infinity", b'{"kind":"mark","life":"x","t":Infinity}'),
    ("overflowing-float", b'{"kind":"mark","life":"x","t":1e999}'),
    ("not-utf8", b'{"kind":"mark","life":"\xff\xfe","t":1.0}'),
    ("not-json", b"\x00\x01garbage"),
    ("a-list", b"[1, 2, 3]"),
    ("long-line", b'{"kind":"mark","life":"' + b"a" * 100_000 + b'","t":1.0}'),
]


@pytest.mark.parametrize("line", [h[1] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_line_is_skipped_and_counted_never_raised(tmp_path, line):
  events = clean_life()
  lines = [e.line() for e in events]
  (tmp_path / goodput.FILE).write_bytes(b"".join(lines[:2]) + line + b"\n"
                                        + b"".join(lines[2:]))
  reading = goodput.read_all(str(tmp_path))
  assert list(reading.events) == events
  assert reading.skipped == 1
  ledger = accounting.account(reading.events, skipped_lines=reading.skipped)
  assert ledger.to_dict()["skipped_lines"] == 1
  assert "1 line of the file skipped" in accounting.table(ledger)


def test_a_torn_line_then_a_fresh_line_loses_only_itself(tmp_path):
  # The sidecar was killed mid-append; the next one starts its append on a fresh line
  # (server/goodput/ledgers.py), so the finish at t=200 after it counts.
  a = [Event("start", "a", 0.5, Counters(), start=0.0, pid=1),
       Event("first_step", "a", 1.0, Counters()), Event("mark", "a", 100.0, Counters())]
  torn = Event("mark", "a", 150.0, Counters()).line()[:20]
  finish = Event("finish", "a", 200.0, Counters())
  (tmp_path / goodput.FILE).write_bytes(b"".join(e.line() for e in a) + torn + b"\n"
                                        + finish.line())
  reading = goodput.read_all(str(tmp_path))
  assert reading.skipped == 1
  assert accounting.account(reading.events).wall_s == 200.0


def test_a_died_event_round_trips_its_stall():
  e = Event("died", "a", 95.0, seen=90.0, stalled=80.0)
  assert Event.from_dict(json.loads(e.line())) == e


def test_a_trainer_never_says_it_is_stalled():
  with pytest.raises(ValueError, match="stalled is the sidecar's to say"):
    goodput.check_events([{"kind": "mark", "life": "a", "t": 1.0, "batches": 1,
                           "stalled": 0.5}], limit=10)


@pytest.mark.parametrize("kind", ["phase", "slow", "died"])
def test_a_trainer_never_writes_what_the_sidecar_saw(kind):
  d = {"kind": kind, "life": "a", "t": 10.0, "begin": 5.0, "name": "eval"}
  with pytest.raises(ValueError, match=f"a {kind} event is the sidecar's to write"):
    goodput.check_events([d], limit=10)


@pytest.mark.parametrize("d, match", [
    ({"kind": "slow", "life": "a", "t": 10.0}, "needs its begin"),
    ({"kind": "slow", "life": "a", "t": 10.0, "begin": 11.0}, "needs its begin"),
    ({"kind": "phase", "life": "a", "t": 10.0, "begin": 1.0}, "needs the phase's name"),
    ({"kind": "phase", "life": "a", "t": 10.0, "begin": 1.0, "name": "x" * 65}, "1 to 64"),
], ids=["no-begin", "begin-after-t", "no-name", "long-name"])
def test_a_span_event_is_checked(d, match):
  with pytest.raises(ValueError, match=match):
    Event.from_dict(d)
