"""A pool's arenas, one memfd per tenant, on real memfds: what they hold together stays within
the sidecar's size (``--shm-size``), however large the tenants' ceilings.

Tier 1: no server; blocks made through ``Leases`` as the sidecar makes them, a tenant
being whoever ``tenants.CURRENT`` names.
"""

import pytest

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server.arenas import arenas as arenas_lib
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.tenancy.tenants import acting_as

pytestmark = pytest.mark.unit

MiB = 1 << 20


@pytest.fixture
def pool():
  """Arenas of 8 MiB together, each tenant's of 6 MiB (the ceilings sum past the size)."""
  arenas = arenas_lib.Arenas(8 * MiB, per_tenant=True, ceiling_of=lambda name: 6 * MiB)
  leases = Leases(arenas)
  yield arenas, leases
  assert arenas.used_bytes == 0, "a test leaked a block"
  arenas.close()


def make(leases, tenant, nbytes, *, write=True):
  with acting_as(tenant):
    pin = leases.new_pin()
    block = leases.alloc(nbytes, pin, timeout=0)
  if write:
    leases.arena_of(block).view(block.offset, block.nbytes)[:] = 1
  return block, pin


def test_each_tenant_gets_a_memfd_of_its_ceiling_with_no_page_made(pool):
  arenas, leases = pool
  a, pa = make(leases, "alice", MiB, write=False)
  b, pb_ = make(leases, "bob", MiB, write=False)
  assert a.arena != b.arena
  alice, bob = arenas.get(a.arena), arenas.get(b.arena)
  assert (alice.tenant, bob.tenant, alice.size, bob.size) == ("alice", "bob", 6 * MiB, 6 * MiB)
  assert arenas.resident_bytes() == 0  # made as they are written, never in advance
  assert leases.block_at(a.offset, arena=a.arena) == a
  leases.release(a.offset, a.generation, pa)
  leases.release(b.offset, b.generation, pb_)


def test_freed_pages_are_kept_until_the_arenas_would_pass_the_size_then_punched(pool):
  arenas, leases = pool
  a, pa = make(leases, "alice", 6 * MiB)
  leases.release(a.offset, a.generation, pa)
  assert arenas.resident_bytes() == 6 * MiB  # kept: her next block there costs no fault
  again, pa = make(leases, "alice", 6 * MiB)  # reused: nothing to punch
  assert arenas.resident_bytes() == 6 * MiB
  leases.release(again.offset, again.generation, pa)
  b, pb_ = make(leases, "bob", 6 * MiB)  # 12 MiB resident would pass 8: hers go
  alice = arenas.current("alice")
  assert alice is not None and alice.resident_bytes() == 0
  assert arenas.resident_bytes() == 6 * MiB
  leases.release(b.offset, b.generation, pb_)


def test_pages_a_worker_wrote_outside_its_blocks_are_punched_too(pool, monkeypatch):
  arenas, leases = pool
  monkeypatch.setattr(arenas_lib, "MEASURE_S", 0.0)  # measured at every block
  a, pa = make(leases, "alice", MiB)
  alice = arenas.get(a.arena)
  alice.arena.buffer[:] = 7  # all her mapping, 5 MiB of it in no block
  assert arenas.resident_bytes() == 6 * MiB
  b, pb_ = make(leases, "bob", 4 * MiB)
  assert alice.resident_bytes() == MiB and (alice.arena.view(a.offset, a.nbytes) == 7).all()
  leases.release(a.offset, a.generation, pa)
  leases.release(b.offset, b.generation, pb_)


def test_the_arenas_together_hand_out_no_more_than_the_size(pool):
  arenas, leases = pool
  a, pa = make(leases, "alice", 6 * MiB, write=False)
  with pytest.raises(errors.ResourceExhaustedError, match="the arena is full"):
    make(leases, "bob", 4 * MiB, write=False)
  b, pb_ = make(leases, "bob", 2 * MiB, write=False)
  assert arenas.used_bytes == 8 * MiB
  leases.release(a.offset, a.generation, pa)
  leases.release(b.offset, b.generation, pb_)


def test_a_retired_arena_closes_with_its_last_block_and_the_name_gets_a_new_one(pool):
  arenas, leases = pool
  a, pa = make(leases, "bob", MiB)
  old = arenas.get(a.arena)
  arenas.retire("bob")
  assert arenas.current("bob") is None and not old.closed  # his block still lives
  leases.release(a.offset, a.generation, pa)
  assert old.closed and arenas.get(a.arena) is None and arenas.num_open() == 0
  b, pb_ = make(leases, "bob", MiB)
  assert b.arena != a.arena
  leases.release(b.offset, b.generation, pb_)


def test_outside_a_pool_one_arena_reserved_at_start(pool):
  arena = shm.Arena.create(2 * MiB)
  arenas = arenas_lib.Arenas.single(arena)
  try:
    leases = Leases(arenas)
    a, pa = make(leases, "alice", MiB)
    b, pb_ = make(leases, "bob", MiB)
    assert a.arena == b.arena == 0 and leases.arena_of(a) is arena
    assert arena.reserved and arenas.resident_bytes() == 2 * MiB
    leases.release(a.offset, a.generation, pa)
    leases.release(b.offset, b.generation, pb_)
  finally:
    arenas.close()


def test_a_raised_ceiling_gives_the_tenant_a_new_arena_and_the_old_one_closes_when_idle():
  ceilings = {"alice": 2 * MiB}
  arenas = arenas_lib.Arenas(8 * MiB, per_tenant=True, ceiling_of=ceilings.get)
  leases = Leases(arenas)
  try:
    a, pa = make(leases, "alice", MiB)
    old = arenas.get(a.arena)
    arenas.refresh()  # no change: kept
    assert arenas.current("alice") is old
    ceilings["alice"] = 6 * MiB
    arenas.refresh()
    b, pb_ = make(leases, "alice", 4 * MiB)  # past the old size: in the new arena
    assert arenas.get(b.arena).size == 6 * MiB and not old.closed
    leases.release(a.offset, a.generation, pa)
    assert old.closed
    leases.release(b.offset, b.generation, pb_)
  finally:
    arenas.close()


def test_a_name_no_tenant_has_now_is_handed_no_arena():
  # A reload removed bob between his worker's token check and its attach, or his feed
  # starts after: the sidecar's own arena (blocks nobody is told of) is never his.
  arenas = arenas_lib.Arenas(8 * MiB, per_tenant=True,
                             ceiling_of=lambda name: 6 * MiB if name == "alice" else None)
  try:
    with pytest.raises(errors.AuthenticationError, match="tenant 'bob' is not in the pool"):
      arenas.bind("w-bob", "bob")
    with pytest.raises(errors.AuthenticationError, match="tenant 'bob' is not in the pool"):
      arenas.enter("bob", handed=True)
    own = arenas.enter("bob")  # a block the sidecar keeps: its own arena, as before
    assert own.tenant is None
    arenas.leave(own)
    assert arenas.bind("w-alice", "alice").tenant == "alice"
    arenas.unbind("w-alice")
  finally:
    arenas.close()


def test_blocks_below_an_arenas_top_reuse_its_pages_and_punch_nothing(pool):
  # A busy pool: the arenas' pages hold all of --shm-size (alice's freed 4 MiB kept, bob's
  # 4 MiB in use). Alice's next blocks fit below her top, in pages she keeps: nothing is
  # punched, however many she makes (punched, her next larger blocks fault their pages anew).
  arenas, leases = pool
  a, pa = make(leases, "alice", 4 * MiB)
  leases.release(a.offset, a.generation, pa)
  b, pb_ = make(leases, "bob", 4 * MiB)
  assert arenas.resident_bytes() == 8 * MiB
  for i in range(50):
    a, pa = make(leases, "alice", MiB, write=False)
    view = leases.arena_of(a).view(a.offset, a.nbytes)
    assert view[0] == (i or 1)  # her page as she left it: never punched
    view[0] = i + 1
    leases.release(a.offset, a.generation, pa)
  assert arenas.resident_bytes() == 8 * MiB and arenas.punches == 0
  c, pc = make(leases, "bob", 2 * MiB)  # past bob's top, and 10 MiB would pass 8: a batch
  assert arenas.punches == 1 and arenas.resident_bytes() == 6 * MiB
  leases.release(b.offset, b.generation, pb_)
  leases.release(c.offset, c.generation, pc)
