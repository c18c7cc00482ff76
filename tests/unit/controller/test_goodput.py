"""The trainer's goodput ledger client (controller/goodput.py), on a fake transport.

Tier 1: no sockets; a fake clock and stopwatch, a transport that keeps what it is sent.
"""

import os

import pytest

from sidecar._src.controller import goodput
from sidecar._src.core import goodput as goodput_core

pytestmark = pytest.mark.unit


class Sent:
  """A LedgerTransport that keeps every message (``busy``: the socket is taken)."""

  def __init__(self):
    self.messages = []
    self.busy = False
    self.refuse = None

  def send_ledger(self, message, *, reply, wait):
    if reply and self.refuse is not None:
      raise self.refuse
    if self.busy and not reply and not wait:
      return False
    self.messages.append(message)
    return True

  def events(self):
    return [goodput_core.Event.from_dict(e) for m in self.messages for e in m["events"]]


class Clock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def ledger_client(sent, clock, **kw):
  return goodput.LedgerClient(sent, start=990.0, pid=7, clock=clock, counter=clock,
                          mark_every=5.0, **kw)


def test_nothing_is_sent_before_the_ledger_is_bound_then_all_of_it_at_once():
  sent, clock = Sent(), Clock()
  r = ledger_client(sent, clock)
  r.batch(2.0, clock())
  clock.now += 1
  r.batch(0.1, clock())  # the second batch: the first step is done
  assert sent.messages == []
  r.bind("/ckpt/run")
  (message,) = sent.messages
  assert message["directory"] == "/ckpt/run"
  kinds = [e.kind for e in sent.events()]
  assert kinds == ["start", "first_step", "mark"]
  start, first, mark = sent.events()
  assert start.start == 990.0 and start.pid == 7 and start.life == "7@990.000"
  assert first.t == 1001.0 and first.counters.batches == 2
  assert mark.counters.data_s == pytest.approx(2.1)


def test_batches_send_a_mark_at_most_every_interval():
  sent, clock = Sent(), Clock()
  r = ledger_client(sent, clock)
  r.bind("/ckpt/run")
  sent.messages.clear()
  for _ in range(100):  # 100 batches over 10 s
    clock.now += 0.1
    r.batch(0.01, clock())
  marks = [e for e in sent.events() if e.kind == "mark"]
  assert len(marks) == 2  # at 5 s and 10 s
  assert r.batches == 100 and r.data_s == pytest.approx(1.0)


def test_a_busy_socket_skips_the_mark_and_the_next_one_carries_the_counters():
  sent, clock = Sent(), Clock()
  r = ledger_client(sent, clock)
  r.bind("/ckpt/run")
  sent.messages.clear()
  sent.busy = True
  clock.now += 6
  r.batch(0.5, clock())
  assert sent.messages == []
  sent.busy = False
  clock.now += 6
  r.batch(0.5, clock())
  (mark,) = [e for e in sent.events() if e.kind == "mark"]
  assert mark.counters.data_s == pytest.approx(1.0)


def test_saves_and_restores_are_sent_at_once_with_their_blocked_time():
  sent, clock = Sent(), Clock()
  r = ledger_client(sent, clock)
  r.bind("/ckpt/run")
  r.restored(40, 3.0)
  r.batch(0.2, clock())
  clock.now += 2
  r.saved(45, 0.5)  # before a second batch: the first save ends the first step
  r.saved(None, 0.25)  # skipped: its time counts, no save event
  kinds = [e.kind for e in sent.events()]
  assert kinds == ["start", "mark", "restore", "first_step", "save"]
  restore, first, save = sent.events()[2:]
  assert restore.step == 40 and restore.counters.restore_s == 3.0
  assert first.t == pytest.approx(1002.0 - 0.5)
  assert save.step == 45 and save.counters.ckpt_s == pytest.approx(0.5)
  assert r.ckpt_s == pytest.approx(0.75)


def test_finish_is_sent_once_and_abandon_sends_no_finish():
  sent, clock = Sent(), Clock()
  r = ledger_client(sent, clock)
  r.bind("/ckpt/run")
  r.finish()
  r.finish()
  assert [e.kind for e in sent.events()].count("finish") == 1
  other = Sent()
  r2 = ledger_client(other, clock)
  r2.bind("/ckpt/run")
  r2.abandon()
  r2.finish()
  assert "finish" not in [e.kind for e in other.events()]


def test_only_the_first_directory_binds():
  sent, clock = Sent(), Clock()
  r = ledger_client(sent, clock)
  r.bind("/ckpt/a")
  r.bind("/ckpt/b")
  assert [m.get("directory") for m in sent.messages] == ["/ckpt/a"]


def test_a_refused_binding_is_logged_and_nothing_more_is_sent(caplog):
  sent, clock = Sent(), Clock()
  sent.refuse = PermissionError("not under a checkpoint root")
  r = ledger_client(sent, clock)
  r.bind("/elsewhere")
  assert "did not take the ledger of /elsewhere" in caplog.text
  sent.refuse = None
  r.saved(5, 0.1)
  clock.now += 10
  r.batch(0.1, clock())
  assert sent.messages == []


def test_the_process_start_is_before_now_and_after_boot():
  import time
  start = goodput.process_start()
  assert time.time() - 3600 * 24 * 365 < start <= time.time()


def test_a_standby_process_counts_its_life_from_when_it_was_told_to_run(monkeypatch):
  monkeypatch.setenv("SIDECAR_STARTED", "1796000000.5")
  assert goodput.process_start() == 1796000000.5
  kernel = goodput.process_start(os.getpid())  # by pid: the kernel's, whatever the env
  assert kernel != 1796000000.5
  monkeypatch.setenv("SIDECAR_STARTED", "not a time")  # the kernel's, not an error
  assert goodput.process_start() == pytest.approx(kernel, abs=0.05)
