"""Who holds each arena block: a block goes back to the allocator with its last holder.

The allocator is the real one over a 1 MiB range; no arena is mapped (Leases never
touches the bytes). Worker sessions are str holders, local pins ``("pin", n)``.
"""

import threading

import pytest

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server.arenas.leases import Leases

pytestmark = pytest.mark.unit

MiB = 1 << 20

SIZE = 1 << 20


@pytest.fixture
def leases():
  leases = Leases(shm.Allocator(SIZE))
  yield leases
  assert leases.allocator.used_bytes == leases.allocator.num_blocks == 0, "a test leaked a block"
  assert leases.holders() == 0


def test_a_block_goes_back_with_its_last_holder(leases):
  pin = leases.new_pin()
  block = leases.alloc(100, pin, timeout=0)
  assert leases.hold(block.offset, block.generation, "w1") == block
  leases.release(block.offset, block.generation, pin)
  assert leases.allocator.used_bytes == shm.ALIGN and leases.block_at(block.offset) == block
  leases.release(block.offset, block.generation, "w1")
  assert leases.allocator.used_bytes == 0 and leases.block_at(block.offset) is None


def test_pins_are_fresh_tokens(leases):
  assert len({leases.new_pin() for _ in range(3)}) == 3


def test_holding_twice_is_one_hold(leases):
  block = leases.alloc(10, "w1", timeout=0)
  leases.hold(block.offset, block.generation, "w1")
  leases.release(block.offset, block.generation, "w1")
  assert leases.block_at(block.offset) is None
  with pytest.raises(errors.StaleDescriptorError, match=r"is not held by 'w1'"):
    leases.release(block.offset, block.generation, "w1")


def test_stale_descriptors_are_refused_and_hold_nothing(leases):
  block = leases.alloc(10, "w1", timeout=0)
  for offset, generation in ((block.offset, block.generation + 1), (block.offset + shm.ALIGN, 1)):
    with pytest.raises(errors.StaleDescriptorError,
                       match=rf"block at offset {offset} generation {generation} is not "
                             r"allocated \(released or reused since the descriptor was made\)"):
      leases.hold(offset, generation, "w2")
  with pytest.raises(errors.StaleDescriptorError, match=r"is not held by 'w2'"):
    leases.release(block.offset, block.generation, "w2")
  assert leases.held_bytes() == ({"w1": shm.ALIGN}, 0)
  leases.release(block.offset, block.generation, "w1")
  # Reused: the same offset with a new generation; the old descriptor stays stale.
  again = leases.alloc(10, "w1", timeout=0)
  assert again.offset == block.offset and again.generation != block.generation
  with pytest.raises(errors.StaleDescriptorError):
    leases.hold(block.offset, block.generation, "w2")
  leases.release_all("w1")


@pytest.mark.parametrize("case", ["not-owner", "wrong-generation", "no-block"],
                         ids=["not-owner", "wrong-generation", "no-block"])
def test_hold_owned_says_the_same_for_every_block_not_ones_own(leases, case):
  """A client learns nothing about other sessions' blocks from the refusal."""
  block = leases.alloc(64, "w1", timeout=0)
  offset, generation, owner = {
      "not-owner": (block.offset, block.generation, "w2"),
      "wrong-generation": (block.offset, block.generation ^ 1, "w1"),
      "no-block": (block.offset + shm.ALIGN, block.generation, "w1"),
  }[case]
  with pytest.raises(errors.StaleDescriptorError) as raised:
    leases.hold_owned(offset, generation, 8, owner=owner, holder=("pin", 9))
  assert str(raised.value) == (
      f"no arena block at offset {offset} generation {generation} is held by this worker "
      "session (released, reused, or never its own); send arrays the worker holds, e.g. from "
      "worker.put() or the results of its calls")
  assert leases.holders() == 1  # the refusal took no hold
  leases.release_all("w1")


@pytest.mark.parametrize("nbytes", [0, shm.ALIGN + 1], ids=["zero", "past-the-block"])
def test_hold_owned_checks_the_bytes_fit_before_holding(leases, nbytes):
  block = leases.alloc(shm.ALIGN, "w1", timeout=0)
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"^nbytes {nbytes} does not fit the arena block at offset "
                           rf"{block.offset}, which has {shm.ALIGN} bytes$"):
    leases.hold_owned(block.offset, block.generation, nbytes, owner="w1", holder=("pin", 0))
  assert leases.holders() == 1
  assert leases.hold_owned(block.offset, block.generation, shm.ALIGN, owner="w1",
                           holder=("pin", 0)) == block
  leases.release_all("w1")
  assert leases.block_at(block.offset) == block  # the pin still holds it
  leases.release(block.offset, block.generation, ("pin", 0))


def test_release_all_lets_go_of_a_session_and_only_it(leases):
  mine = [leases.alloc(10, "w1", timeout=0) for _ in range(3)]
  theirs = leases.alloc(10, "w2", timeout=0)
  shared = mine[0]
  leases.hold(shared.offset, shared.generation, "w2")
  assert leases.release_all("w1") == 3
  assert leases.release_all("w1") == 0
  assert leases.held_bytes() == ({"w2": 2 * shm.ALIGN}, 0)
  assert leases.allocator.num_blocks == 2
  assert leases.release_all("w2") == 2
  del theirs


def test_held_bytes_counts_each_session_and_blocks_only_pins_hold(leases):
  pin = leases.new_pin()
  a = leases.alloc(shm.ALIGN, "w1", timeout=0)
  b = leases.alloc(3 * shm.ALIGN, pin, timeout=0)
  leases.hold(a.offset, a.generation, "w2")
  leases.hold(a.offset, a.generation, pin)  # held by sessions too: not counted as pinned
  assert leases.held_bytes() == ({"w1": shm.ALIGN, "w2": shm.ALIGN}, 3 * shm.ALIGN)
  assert leases.holders() == 3
  for holder in ("w1", "w2", pin):
    leases.release_all(holder)
  del b


def test_a_full_arena_says_so_and_alloc_holds_nothing(leases):
  block = leases.alloc(SIZE, "w1", timeout=0)
  with pytest.raises(errors.ResourceExhaustedError, match=r"the arena is full"):
    leases.alloc(1, "w2", timeout=0)
  with pytest.raises(errors.ResourceExhaustedError, match=r"cannot fit an arena of 1\.0 MiB"):
    leases.alloc(SIZE + 1, "w2", timeout=0)
  assert leases.holders() == 1
  leases.release(block.offset, block.generation, "w1")


def test_concurrent_holders_release_every_block_once(leases):
  blocks = [leases.alloc(shm.ALIGN, ("pin", i), timeout=0) for i in range(32)]

  def session(name):
    for b in blocks:
      leases.hold(b.offset, b.generation, name)
    leases.release_all(name)

  for i, b in enumerate(blocks):
    leases.hold(b.offset, b.generation, "keeper")
    leases.release(b.offset, b.generation, ("pin", i))
  threads = [threading.Thread(target=session, args=(f"w{i}",)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert leases.allocator.num_blocks == 32 and leases.holders() == 1
  assert leases.release_all("keeper") == 32


def test_a_wait_lets_go_of_no_more_than_it_lacks_while_the_copies_come_back():
  # The RAM tier let go of a copy, but a restore still reads its blocks: they come back
  # later. Asking the whole shortfall again each turn dropped a copy a turn, every one.
  asked = []
  def reclaim(nbytes, tenant):
    asked.append(nbytes)
    return 4 * MiB  # a copy went; its blocks are still read elsewhere
  leases = Leases(shm.Allocator(8 * MiB), reclaim=reclaim)
  pin = leases.new_pin()
  held = leases.alloc(8 * MiB, pin, timeout=0)
  with pytest.raises(errors.ResourceExhaustedError):
    leases.alloc(4 * MiB, leases.new_pin(), timeout=2.5)
  assert asked == [4 * MiB]  # once: what it lacked, then it waited for the blocks
  leases.release(held.offset, held.generation, pin)
