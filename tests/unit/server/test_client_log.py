"""What a client's requests write to the log (server/client_log.py): a bucket of lines per
client, one summary line of what was dropped, the sidecar's own lines never held."""

import logging

import pytest

from sidecar._src.server import client_log

pytestmark = pytest.mark.unit
log = logging.getLogger("sidecar.test_client_log")


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now


def messages(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records]


@pytest.fixture
def said(caplog):
  caplog.set_level(logging.INFO, logger="sidecar")
  clock = Clock()
  return client_log.ClientLog(burst=3, per_s=1.0, summary_s=10.0, clock=clock), clock


def test_a_client_past_its_burst_is_dropped_then_summarized_once_it_may_write(said, caplog):
  logs, clock = said
  passed = [logs.warning(log, "tenant 'bob'", "bad frame %d", i) for i in range(100)]
  assert passed == [True] * 3 + [False] * 97 and logs.dropped("tenant 'bob'") == 97
  assert messages(caplog) == ["bad frame 0", "bad frame 1", "bad frame 2"]
  clock.now += 1.0  # one line's worth
  assert logs.warning(log, "tenant 'bob'", "bad frame %d", 100)
  assert messages(caplog)[3:] == [
      "tenant 'bob': 97 log lines dropped in the last 1.0 s (a client's requests write at most "
      "3 lines at once, then 1 a second); the last: bad frame 99", "bad frame 100"]
  assert logs.dropped("tenant 'bob'") == 0


def test_one_client_s_flood_never_holds_another_s_lines_nor_the_sidecar_s(said, caplog):
  logs, _ = said
  for i in range(50):
    logs.warning(log, "tenant 'bob'", "bob %d", i)
  assert logs.warning(log, "tenant 'alice'", "alice's line")
  assert logs.warning(log, None, "the sidecar's own")
  assert "alice's line" in messages(caplog) and "the sidecar's own" in messages(caplog)


def test_a_client_that_went_quiet_is_summarized_by_anyone_s_later_line_or_a_flush(said, caplog):
  logs, clock = said
  for i in range(10):
    logs.info(log, "worker session w-1", "line %d", i)
  clock.now += 11.0
  logs.info(log, "tenant 'alice'", "alice")
  assert messages(caplog)[3].startswith(
      "worker session w-1: 7 log lines dropped in the last 11.0 s")
  for i in range(10):
    logs.info(log, "worker session w-2", "line %d", i)
  logs.flush("worker session w-2")
  assert messages(caplog)[-1].startswith("worker session w-2: 7 log lines dropped")
  logs.flush()  # owed nothing more
  assert len(messages(caplog)) == 3 + 1 + 1 + 3 + 1


def test_a_dropped_line_is_not_formatted(said):
  logs, _ = said

  class Costly:
    formatted = 0

    def __str__(self):
      Costly.formatted += 1
      return "costly"
  for _ in range(3):
    logs.warning(log, "tenant 'bob'", "%s", Costly())
  written = Costly.formatted  # by each handler of the written lines
  for _ in range(1000):
    assert not logs.warning(log, "tenant 'bob'", "%s", Costly())
  assert Costly.formatted == written  # a dropped line costs a count
