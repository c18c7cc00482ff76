"""The arena side of calls, on a real arena: who holds each block, and when it goes back.

Tier 1: no server, no processes; a worker session is just a name here.
"""

import gc

import numpy as np
import pytest

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server.arenas.arena_io import ArenaIO, BatchBlocks
from sidecar._src.server.arenas.arenas import Arenas
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.wire import codec
from tests.conftest import eventually

pytestmark = pytest.mark.unit

SESSION = "w-test"


@pytest.fixture
def io():
  arena = shm.Arena.create(2 << 20)
  leases = Leases(Arenas.single(arena))
  io = ArenaIO(leases, inline_limit=1024, is_attached=lambda s: s == SESSION)
  yield io
  io.close()
  io.close()  # idempotent
  arena.close()


def _forever():
  return True


def _no_deadline():
  return None


def test_a_feed_without_a_worker_pins_its_batches_until_they_are_sent_inline(io):
  blocks = BatchBlocks(io, "", _forever, _no_deadline)
  sent = {"x": blocks.alloc((4, 8), np.dtype(np.float32))}
  unsent = blocks.alloc((16,), np.dtype(np.uint8))
  assert blocks.to_arena(sent["x"]) is None  # inline
  assert io.leases.held_bytes() == ({}, 2 * shm.ALIGN)
  blocks.sent(sent)
  assert io.leases.held_bytes() == ({}, shm.ALIGN)
  blocks.close()
  blocks.close()  # idempotent
  assert io.leases.allocator.used_bytes == 0
  del unsent


def test_sent_finds_every_array_of_a_nested_batch(io):
  # A batch tree as the feed sends it: per-range lists of arrays inside dicts and tuples.
  blocks = BatchBlocks(io, "", _forever, _no_deadline)
  alloc = lambda: blocks.alloc((2,), np.dtype(np.int32))
  tree = {"x": [alloc(), alloc()], "y": ({"z": [alloc()]}, "tag", None), "n": 3}
  assert io.leases.held_bytes() == ({}, 3 * shm.ALIGN)
  blocks.sent(tree)
  assert io.leases.held_bytes() == ({}, 0)
  blocks.close()


def test_a_feed_for_a_worker_leases_it_what_was_sent_and_takes_back_the_rest(io):
  blocks = BatchBlocks(io, SESSION, _forever, _no_deadline)
  sent = blocks.alloc((3,), np.dtype(np.int64))
  blocks.alloc((3,), np.dtype(np.int64))  # made, never sent
  ref = blocks.to_arena(sent)
  assert isinstance(ref, codec.ArenaRef) and ref.shape == (3,) and ref.nbytes == 24
  blocks.sent({"x": sent})  # the worker frees what it got
  blocks.close()
  assert io.leases.held_bytes() == ({SESSION: shm.ALIGN}, 0)
  io.leases.release(ref.offset, ref.generation, SESSION)
  assert io.leases.allocator.used_bytes == 0


def _ends(io, attached: set[str]) -> None:
  """Ends worker session SESSION as Workers._serve does: it leaves, then its blocks go."""
  attached.discard(SESSION)
  io.leases.release_all(SESSION)


def test_a_feed_torn_down_after_its_sessions_end_gives_back_the_rest(io):
  # The trainer was SIGKILLed while its feed filled batches ahead: its session's end
  # released those; the feed's teardown, after, passes over them and gives back the rest.
  attached = {SESSION}
  io.is_attached = attached.__contains__
  blocks = BatchBlocks(io, SESSION, _forever, _no_deadline)
  blocks.alloc((3,), np.dtype(np.int64))  # in flight at the end
  pinned = BatchBlocks(io, "", _forever, _no_deadline)
  pinned.alloc((3,), np.dtype(np.int64))
  _ends(io, attached)
  blocks.close()  # no StaleDescriptorError
  pinned.close()
  assert io.leases.allocator.used_bytes == 0


def test_a_block_made_for_a_session_after_its_end_goes_back_at_once(io):
  # The feed's producer made its next batch after the session's blocks went back: the
  # lease would outlive everything that releases the session's blocks.
  attached = {SESSION}
  io.is_attached = attached.__contains__
  blocks = BatchBlocks(io, SESSION, _forever, _no_deadline)
  blocks.alloc((3,), np.dtype(np.int64))
  _ends(io, attached)
  with pytest.raises(errors.ClosedError, match=f"worker session {SESSION} ended"):
    blocks.alloc((3,), np.dtype(np.int64))
  answers = iter([True])  # a stream's item: it started before the end, its block after
  io.is_attached = lambda session: next(answers, False)
  with pytest.raises(errors.ClosedError):
    io.encode(np.zeros(4096, np.uint8), SESSION, alive=_forever, time_left=_no_deadline,
              where="item 0")
  blocks.close()
  assert io.leases.allocator.used_bytes == 0
  assert io.leases.held_bytes() == ({}, 0)


def test_a_batch_whose_encoding_failed_gives_back_every_block(io):
  blocks = BatchBlocks(io, SESSION, _forever, _no_deadline)
  first = blocks.alloc((3,), np.dtype(np.int64))
  blocks.alloc((3,), np.dtype(np.int64))
  assert isinstance(blocks.to_arena(first), codec.ArenaRef)  # then the encode raised
  blocks.close()  # no sent(): nothing of the batch reached the worker
  assert io.leases.held_bytes() == ({}, 0)
  assert io.leases.allocator.used_bytes == 0


def test_a_view_of_a_workers_block_pins_it_until_the_view_dies(io):
  block = io.leases.alloc(64, SESSION, timeout=0)
  ref = codec.ArenaRef(block.offset, 64, block.generation, "uint8", (64,))
  view = io.view(ref, SESSION)
  io.leases.release(block.offset, block.generation, SESSION)  # the worker lets go first
  assert io.leases.allocator.used_bytes == shm.ALIGN  # the view still reads it
  del view
  gc.collect()
  assert eventually(lambda: io.leases.allocator.used_bytes == 0)
  with pytest.raises(errors.InvalidArgumentError, match="worker_session 'w-other'"):
    io.view(ref, "w-other")


def test_a_result_too_big_for_the_arena_fails_at_once_and_holds_nothing(io):
  with pytest.raises(errors.ResourceExhaustedError):
    io.encode(np.zeros(4 << 20, np.uint8), SESSION, alive=_forever, time_left=_no_deadline,
              where="result")
  assert io.leases.allocator.used_bytes == 0
  small = io.encode(np.arange(3), "", alive=_forever, time_left=_no_deadline, where="result")
  assert small.WhichOneof("kind") != "arena"
