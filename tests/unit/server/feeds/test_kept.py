"""The store of kept feed batches (``server/feeds/kept.py``) over real leases: what it
keeps, for whom, within which bounds, and what lets a kept batch go. No arena is mapped:
the store never touches a batch's bytes (its streams do)."""

import pytest

from sidecar._src.arena import shm
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.feeds import kept as kept_lib, producer
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit

SIZE = 1 << 20
BLOCK = 4096  # each batch here: one leaf, one range, one block


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


@pytest.fixture
def leases():
  leases = Leases(shm.Allocator(SIZE))
  yield leases
  assert leases.allocator.used_bytes == 0, "a test left a block held"


@pytest.fixture
def clock():
  return Clock()


@pytest.fixture
def store(leases, clock):
  store = kept_lib.KeptBatches(leases, clock=clock)
  yield store
  store.close()


def key(*, seed=0, **changes):
  spec = producer.Spec(global_batch_size=4, ranges=((0, 4),), seed=seed, num_epochs=None,
                       shard_index=0, shard_count=1, start={}, workers=0)
  fields = dict(tenant=None, pipeline="rows", code_hash="abc", kwargs=pb.Value(), spec=spec,
                data=None)
  fields.update(changes)
  return kept_lib.FeedKey.of(**fields)


def make(leases, session="w1"):
  """A batch's block, held by worker ``session`` as a sent batch is."""
  block = leases.alloc(BLOCK, session, timeout=0)
  return ((codec.ArenaRef(block.offset, BLOCK, block.generation, "uint8", (BLOCK,)),),)


def keep(store, leases, k, position, *, limit=100, session="w1", arena_size=SIZE):
  refs = make(leases, session)
  state = {"kind": "map", "epoch": 0, "position": position + 4}
  kept = store.keep(k, (0, position), pb.Value(), refs, state, arena=0,
                    arena_size=arena_size, crc=0, limit=limit)
  leases.release_all(session)  # the trainer is done with it
  return kept


def test_a_stream_opened_where_kept_batches_follow_gets_them_in_order(store, leases):
  k = key()
  for position in (0, 4, 8):
    assert keep(store, leases, k, position)
  pin = leases.new_pin(0)
  chain = store.open(k, (0, 4), holder=pin, arena=0)
  assert [c.at for c in chain] == [(0, 4), (0, 8)]
  assert store.positions(k) == [(0, 4), (0, 8)]  # those before where it opened went
  store.closed(k)
  leases.release_all(pin)


def test_a_stream_of_another_key_gets_none(store, leases):
  keep(store, leases, key(), 0)
  for other in (key(pipeline="other"), key(code_hash="def"), key(data="sha256:1"),
                key(tenant="b"), key(kwargs=codec.encode({"scale": 2})),
                key(spec=producer.Spec(4, ((0, 2),), 0, None, 0, 1, {}, 0))):
    assert store.open(other, (0, 0), holder=leases.new_pin(0), arena=0) == []
    store.closed(other)
  assert store.count() == 1


def test_keeping_stops_at_the_limit_and_at_a_share_of_the_arena(store, leases):
  k = key()
  assert [keep(store, leases, k, 4 * i, limit=2) for i in range(4)] == [True, True, False,
                                                                         False]
  assert store.positions(k) == [(0, 0), (0, 4)]  # the oldest since the save stay
  other = key(seed=1)
  # A quarter of 48 KiB is 3 blocks of 4 KiB, whichever key holds them: 2 of k's, 1 more.
  assert [keep(store, leases, other, 4 * i, arena_size=12 * BLOCK) for i in range(2)] == [
      True, False]
  store.close()
  assert [keep(store, leases, other, 4 * i, arena_size=12 * BLOCK) for i in range(4)] == [
      True, True, True, False]


def test_a_save_lets_go_of_the_batches_before_it(store, leases):
  k = key()
  for position in range(0, 20, 4):
    keep(store, leases, k, position)
  assert store.saved(k, (0, 12)) == 3
  assert store.positions(k) == [(0, 12), (0, 16)]
  assert leases.allocator.used_bytes == 2 * BLOCK


def test_reclaim_lets_go_of_the_tenants_own_newest_first(store, leases, clock):
  a, b = key(tenant="a"), key(tenant="b")
  for position in (0, 4, 8):
    keep(store, leases, a, position)
    keep(store, leases, b, position)
    clock.now += 1
  assert store.reclaim(BLOCK + 1, "b") == 2 * BLOCK
  assert store.positions(b) == [(0, 0)] and store.positions(a) == [(0, 0), (0, 4), (0, 8)]
  assert store.reclaim(SIZE, "b") == 4 * BLOCK and store.count() == 0
  assert leases.allocator.used_bytes == 0


def test_a_key_no_stream_used_for_idle_s_loses_its_batches(store, leases, clock):
  k, busy = key(), key(seed=2)
  keep(store, leases, k, 0)
  keep(store, leases, busy, 0)
  pin = leases.new_pin(0)
  store.open(busy, (0, 4), holder=pin, arena=0)  # a stream of busy stays open
  clock.now += kept_lib.IDLE_S + 1
  assert store.open(key(seed=3), (0, 0), holder=pin, arena=0) == []  # any look expires
  assert store.count(k) == 0 and store.count(busy) == 0  # busy's: before where it opened
  store.closed(busy)
  store.closed(key(seed=3))
  leases.release_all(pin)


def test_a_kept_block_stays_held_until_the_stream_serves_it(store, leases):
  k = key()
  keep(store, leases, k, 0)
  pin = leases.new_pin(0)
  [kept] = store.open(k, (0, 0), holder=pin, arena=0)
  assert store.reclaim(SIZE) == BLOCK  # let go of by the store...
  assert leases.allocator.used_bytes == BLOCK  # ...but the stream's hold keeps it
  leases.release_all(pin)
  store.closed(k)
  assert leases.allocator.used_bytes == 0
  del kept


@pytest.mark.parametrize("text,want", [
    ('{"kind": "map", "epoch": 1, "position": 8}', (1, 8)),
    ('{"epoch": 0, "position": -1}', None), ("not json", None), ("[1]", None),
    ('{"epoch": true, "position": 0}', None)], ids=["state", "negative", "garbage", "list",
                                                    "bool"])
def test_a_told_save_is_read_or_ignored(text, want):
  assert kept_lib.told_position(text) == want
