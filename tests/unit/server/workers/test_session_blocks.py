"""A worker session's frees (server/workers/session_blocks.py) against the real Leases and
Steps: a free that comes after its session ended is no stale free (issue 71 item 5);
tests/processes/server/test_session_end.py meets the race itself.

``sidecar launch`` stopped by SIGTERM after a save printed ``[sidecar 0] WARNING worker
w-...: arena block at offset 12288 generation ... is not held by 'w-...'`` three times.
That warning comes only from these frees; once its trainer is gone, a session's frees can
come only from its other connections, handled after its attach connection ended the
session and released every block it held: its feed's credits read late (each hands a
batch's blocks back), the item its stream could not send. Those blocks were already
back; nothing went wrong.
"""

import logging

import pytest

from sidecar._src.arena import shm
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.goodput import steps as steps_lib
from sidecar._src.server.workers.session_blocks import SessionBlocks

pytestmark = pytest.mark.unit

SESSION = "w-0123456789abcdef"


@pytest.fixture
def blocks():
  leases = Leases(shm.Allocator(1 << 20))
  steps = steps_lib.Steps(10.0)
  steps.attach(SESSION, pid=4242)
  yield SessionBlocks(leases, steps)
  assert leases.allocator.used_bytes == 0 and leases.holders() == 0, "a test leaked a block"


def _end(blocks: SessionBlocks) -> int:
  """The session's end, as ``Workers._serve`` ends it: out of the steps, then every block
  it held released."""
  blocks.steps.end(SESSION)
  return blocks._leases.release_all(SESSION)


def test_a_free_read_after_its_session_ended_warns_of_nothing(blocks, caplog):
  [[offset, _, generation], [offset2, _, generation2]] = blocks.alloc([4096, 4096], SESSION, 0)
  assert _end(blocks) == 2
  with caplog.at_level(logging.DEBUG, logger="sidecar"):
    blocks.free(SESSION, [offset, generation, offset2, generation2])  # credits read late
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_block_made_for_it_after_its_end_is_still_released_by_its_free(blocks, caplog):
  # Its stream's producer made a batch meanwhile, held in its name, that it could not
  # send: that free must release it (the fixture checks that no block is left).
  _end(blocks)
  [[offset, _, generation]] = blocks.alloc([4096], SESSION, 0)
  with caplog.at_level(logging.DEBUG, logger="sidecar"):
    blocks.free(SESSION, [offset, generation])
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_stale_free_of_a_live_session_is_still_warned_of(blocks, caplog):
  [[offset, _, generation]] = blocks.alloc([4096], SESSION, 0)
  blocks.free(SESSION, [offset, generation])
  with caplog.at_level(logging.DEBUG, logger="sidecar"):
    blocks.free(SESSION, [offset, generation])  # the worker's mistake: freed twice
  [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert warning.startswith(
      f"worker {SESSION}: 1 of the 1 arena blocks it freed are not held by it (released "
      f"already, reused, or never its own), e.g. offset {offset} generation {generation}")
  _end(blocks)


def test_a_frame_of_many_stale_blocks_is_one_line_and_frees_the_rest(blocks, caplog):
  """Issue 76: a 1 MB free frame of stale pairs wrote a line per pair (35 MB of log, 8 s
  of the sidecar's CPU). Its session's own blocks in it still go back."""
  mine = blocks.alloc([4096, 4096], SESSION, 0)
  flat = [x for offset, _, generation in mine for x in (offset, generation)]
  stale = [0, 1] * 100_000
  with caplog.at_level(logging.DEBUG, logger="sidecar"):
    blocks.free(SESSION, stale + flat)
  [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert "100000 of the 100002 arena blocks it freed are not held by it" in warning
  assert blocks._leases.held_bytes()[0].get(SESSION, 0) == 0  # its two came back
  _end(blocks)
