"""Tier 1: a trainer's output relayed by ``sidecar launch`` (tools/trainers.py), prefixed
line by line; how a trainer ended, in words."""

import io
import threading

import pytest

from sidecar._src.tools import trainers

pytestmark = pytest.mark.unit


class Writes(io.BytesIO):
  """Records each write: what another trainer's pump could land between."""

  def __init__(self):
    super().__init__()
    self.writes: list[bytes] = []

  def write(self, data) -> int:
    self.writes.append(bytes(data))
    return super().write(data)


def pump(data: bytes) -> Writes:
  out = Writes()
  trainers.pump(io.BufferedReader(io.BytesIO(data)), b"[host 1] ", out, threading.Lock())
  return out


def test_each_line_is_prefixed_and_a_partial_last_line_ends_in_the_same_write():
  out = pump(b"pid=7\nlast line without newline")
  assert out.getvalue() == b"[host 1] pid=7\n[host 1] last line without newline\n"
  # One write for the last line and its newline: another host's line cannot land between.
  assert out.writes == [b"[host 1] pid=7\n", b"[host 1] last line without newline\n"]


def test_a_line_longer_than_a_chunk_is_prefixed_once(monkeypatch):
  monkeypatch.setattr(trainers, "READ_CHUNK", 4)
  out = pump(b"abcdefghij\nxy\n")
  assert out.getvalue() == b"[host 1] abcdefghij\n[host 1] xy\n"


def test_empty_output_writes_nothing():
  assert pump(b"").writes == []


@pytest.mark.parametrize("code, status, words", [
    (0, 0, "exited with code 0"), (3, 3, "exited with code 3"),
    (-9, 137, "was killed by SIGKILL"), (-15, 143, "was killed by SIGTERM"),
], ids=["ok", "failed", "sigkill", "sigterm"])
def test_how_a_trainer_ended_as_a_shell_says_it(code, status, words):
  assert trainers.exit_status(code) == status
  assert trainers.how(code) == words
