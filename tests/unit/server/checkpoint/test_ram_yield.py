"""The RAM tier gives way: durable copies go for new work's arena room or an operator's
drop, oldest commit first, a pool tenant's own first; a step not durable yet never goes.

A real arena and a real :class:`Leases` with the reclaim hook, as the server wires them;
no server, no processes.
"""

import pytest

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.records import ShardId
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.checkpoint import ram_tier, ram_yield
from tests.support.ram_steps import make_step

pytestmark = pytest.mark.unit

D = "/ck/run"
KB = shm.ALIGN  # one arena block per shard
BLOCKS = shm.MIN_SIZE // KB  # the arena's blocks


def item(step, directory=D):
  return f"{directory}/{step}/default"


def add_step(arena, tier, step, *, blocks=1, directory=D, committed=False, done=True):
  """This host's own shards of ``step`` (``blocks`` arena blocks, each freed as its view
  dies), as a finished write (``done``) or one still being written."""
  arena, leases = arena
  shards = {}
  for i in range(blocks):
    pin = leases.new_pin()
    block = leases.alloc(KB, pin, timeout=0)
    shards[ShardId(("w",), ((i, i + 1),))] = arena.lease(
        block.offset, KB,
        lambda b=block, p=pin: leases.release(b.offset, b.generation, p))
  own = make_step(directory, step, item(step, directory), shards, written=done)
  tier.add(own)
  if committed:
    tier.mark_committed(own.final_dir)


def commit(tier, arena, step, **kw):
  add_step(arena, tier, step, **kw)
  return tier.mark_committed(item(step, kw.get("directory", D)))


class Evictions(metrics_lib.Recorder):
  """Records what the RAM tier reports."""

  def __init__(self):
    self.evicted: list[tuple[str, int]] = []

  def ram_tier_evicted(self, reason: str, nbytes: int) -> None:
    self.evicted.append((reason, nbytes))


@pytest.fixture
def setup():
  """An arena whose Leases ask the RAM tier for room, as server.py wires them."""
  arena = shm.Arena.create(shm.MIN_SIZE)
  tier = ram_tier.RamTier(0, uncommitted_s=3600.0)
  recorder = Evictions()
  spare: dict[str, int] = {}
  yielding = ram_yield.Yielding(tier, metrics=recorder, spare=lambda t: spare.get(t, 0))
  leases = Leases(shm.Allocator(arena.size), reclaim=yielding.reclaim,
                  holds=lambda tenant: yielding.describe())
  yield (arena, leases), tier, yielding, recorder, spare
  tier.clear()
  assert leases.allocator.used_bytes == 0, "a staged block was never freed"
  arena.close()


def steps_held(tier) -> list[tuple[str, int]]:
  return sorted((s.directory, s.step) for s in tier.steps())


def test_a_full_arena_evicts_durable_copies_oldest_commit_first(setup):
  arena, tier, _, recorder, _ = setup
  tier.configure(D, 5, None)
  tier.configure("/ck/b", 5, None)
  commit(tier, arena, 2, blocks=BLOCKS // 4)
  commit(tier, arena, 1, blocks=BLOCKS // 4, directory="/ck/b")
  commit(tier, arena, 3, blocks=BLOCKS // 2)  # the arena is full now
  leases = arena[1]
  block = leases.alloc(BLOCKS // 2 * KB, "pin", timeout=0)  # fails at once without the hook
  assert steps_held(tier) == [(D, 3)]  # the two oldest commits went, the newest stayed
  assert recorder.evicted == [("room", BLOCKS // 4 * KB)] * 2
  leases.release(block.offset, block.generation, "pin")


def test_ram_steps_and_ram_budget_keep_copies_while_memory_is_free_reserve_nothing(setup):
  arena, tier, _, _, _ = setup
  tier.configure(D, 10, 1 << 30)  # keep 10 steps within 1 GiB: more than the arena
  commit(tier, arena, 1, blocks=BLOCKS // 2)
  assert commit(tier, arena, 2, blocks=BLOCKS // 2) == [1, 2]  # both kept: memory is free
  leases = arena[1]
  block = leases.alloc(BLOCKS // 4 * KB, "pin", timeout=0)  # new work: the oldest gives way
  assert steps_held(tier) == [(D, 2)]
  leases.release(block.offset, block.generation, "pin")


def test_only_as_much_as_is_missing_goes(setup):
  arena, tier, yielding, _, _ = setup
  tier.configure(D, 5, None)
  for step in (1, 2, 3):
    commit(tier, arena, step, blocks=BLOCKS // 4)
  assert yielding.reclaim(KB) == BLOCKS // 4 * KB
  assert steps_held(tier) == [(D, 2), (D, 3)]


def test_a_step_not_durable_yet_never_goes_and_the_error_says_it_holds_the_arena(setup):
  arena, tier, yielding, recorder, _ = setup
  add_step(arena, tier, 4, blocks=BLOCKS // 2, done=False)  # being written
  add_step(arena, tier, 5, blocks=BLOCKS // 2 - 1, directory="/ck/b")  # waiting for commit
  with pytest.raises(errors.ResourceExhaustedError) as e:
    arena[1].alloc(4 * KB, "pin", timeout=0)
  message = str(e.value)
  assert "the arena is full: 16.0 KiB asked, 4.0 KiB free of 1.0 MiB" in message
  assert f"{D} step 4 (512.0 KiB, being written: not durable yet, kept)" in message
  assert "/ck/b step 5 (508.0 KiB, waiting for its commit: not durable yet, kept)" in message
  assert "raise --shm-size" in message
  assert len(tier.steps()) == 2 and recorder.evicted == []
  assert yielding.reclaim(BLOCKS * KB) == 0


def test_a_pool_tenants_own_copies_go_first_then_others_beyond_their_guarantee(setup):
  arena, tier, yielding, _, spare = setup
  for directory, group in (("/ck/alice", "alice"), ("/ck/bob", "bob"), ("/ck/carol", "carol")):
    tier.set_group(directory, group)
    tier.configure(directory, 5, None)
  quarter = BLOCKS // 4 * KB
  commit(tier, arena, 1, blocks=BLOCKS // 4, directory="/ck/bob")  # the oldest
  commit(tier, arena, 2, blocks=BLOCKS // 4, directory="/ck/carol")
  commit(tier, arena, 3, blocks=BLOCKS // 4, directory="/ck/alice")
  spare["carol"] = quarter  # carol holds a quarter beyond her guarantee, bob nothing
  assert yielding.reclaim(1, "alice") == quarter
  assert steps_held(tier) == [("/ck/bob", 1), ("/ck/carol", 2)]  # alice's own went first
  assert yielding.reclaim(2 * quarter, "alice") == quarter  # carol's; bob's is guaranteed
  assert steps_held(tier) == [("/ck/bob", 1)]


def test_an_operator_drops_durable_copies_and_the_rest_are_reported(setup):
  arena, tier, yielding, recorder, _ = setup
  tier.configure(D, 5, None)
  commit(tier, arena, 1)
  commit(tier, arena, 2)
  add_step(arena, tier, 3, done=False)
  commit(tier, arena, 9, directory="/ck/other")
  dropped, kept = yielding.drop(lambda d: d == D)
  assert [(c.step, c.state) for c in dropped] == [(1, "durable"), (2, "durable")]
  assert [(c.step, c.state) for c in kept] == [(3, "being written")]
  assert steps_held(tier) == [("/ck/other", 9), (D, 3)]
  assert recorder.evicted == [("operator", KB)] * 2
  assert arena[1].allocator.num_blocks == 2


def test_describe_lists_every_directory_and_state(setup):
  arena, tier, yielding, _, _ = setup
  assert yielding.describe() == "no RAM-tier steps"
  tier.configure(D, 5, None)
  commit(tier, arena, 1)
  commit(tier, arena, 2)
  assert yielding.describe() == (
      f"RAM-tier steps: {D} steps 1, 2 (8.0 KiB, durable, still read or held elsewhere)")
  assert tier.find(item(1)) is not None


def test_describe_names_only_the_directories_the_asking_client_may_see(setup):
  arena, tier, yielding, _, _ = setup
  tier.configure(D, 5, None)
  commit(tier, arena, 1)
  add_step(arena, tier, 2, directory="/ck/bob", done=False)
  commit(tier, arena, 3, directory="/ck/carol")
  assert yielding.describe(lambda d: d == D) == (
      f"RAM-tier steps: {D} step 1 (4.0 KiB, durable, still read or held elsewhere); "
      "other clients' steps (4.0 KiB, not durable yet, kept); "
      "other clients' steps (4.0 KiB, durable, still read or held elsewhere)")


def test_a_tenant_s_spare_that_asks_the_tier_does_not_deadlock(setup):
  """The tier runs no caller's code under its lock: a pool's ``spare`` (the tenants' own
  accounting) that reads the tier back, as a quota's may, gets its answer (under the lock
  it deadlocked: the tier's lock is not reentrant)."""
  import threading

  arena, tier, yielding, _, _ = setup
  for directory, group in (("/ck/alice", "alice"), ("/ck/bob", "bob")):
    tier.set_group(directory, group)
    tier.configure(directory, 5, None)
  quarter = BLOCKS // 4 * KB
  commit(tier, arena, 1, blocks=BLOCKS // 4, directory="/ck/bob")
  yielding.spare = lambda tenant: tier.group_use()[tenant][1]  # all of bob's is spare
  got: list[int] = []
  asking = threading.Thread(target=lambda: got.append(yielding.reclaim(1, "alice")),
                            daemon=True)
  asking.start()
  asking.join(10)
  assert not asking.is_alive(), "the reclaim deadlocked on the RAM tier's lock"
  assert got == [quarter] and steps_held(tier) == []


def test_a_replica_s_piece_gets_its_block_from_durable_copies(setup):
  """A replica's piece allocates its block in the arena, which may ask the tier to give
  way: made outside the tier's lock, the allocation gets the room of a durable copy (under
  it, the reclaim found the lock busy and the allocation failed with the room there)."""
  arena, tier, _, _, _ = setup
  tier.configure(D, 5, None)
  commit(tier, arena, 1, blocks=BLOCKS)  # the arena is full of a durable copy
  leases = arena[1]
  pin = leases.new_pin()
  made = []

  def make():
    block = leases.alloc(KB, pin, timeout=0)
    made.append(block)
    return arena[0].lease(block.offset, KB, lambda: None)

  replica = tier.open_replica("/ck/b", 7, item(7, "/ck/b"), source=1)
  entry = tier.replica_piece(replica, ShardId(("w",), ((0, 1),)), make)
  assert entry[1] == 0 and len(made) == 1 and steps_held(tier) == []
  del entry
  tier.discard_partial(replica)
  leases.release(made[0].offset, made[0].generation, pin)
