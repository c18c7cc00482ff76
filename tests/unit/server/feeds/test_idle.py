"""The idle feed workers (``server/feeds/idle.py``): which stream adopts an ended stream's
workers, what they count against, and when they go. The store over real quotas (a real
pool file's ``Tenancy``) and a worker group of its own (the processes' side, drain and
adopt, runs in tests/processes/server/feeds/test_idle_workers.py)."""

import contextlib
import os
import threading

import pytest

from sidecar._src.core import errors
from sidecar._src.server.feeds import idle as idle_lib, kept as kept_lib, producer
from sidecar._src.server.pool import pool_file
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.user import data_roots
from sidecar._src.wire import codec
from tests.conftest import eventually

pytestmark = pytest.mark.unit


class Group:
  """A feed's worker processes as the store sees them (``processes.FeedProcesses``)."""
  _next = iter(range(1000, 10**6, 10))

  def __init__(self, size=2, *, drains=True, slowest_s=0.0):
    first = next(Group._next)
    self.pids = list(range(first, first + size))
    self.drains, self.slowest_s = drains, slowest_s
    self.drained = []  # the timeouts drain() was given
    self.adopted = []  # (size, turns, alive) of each adoption
    self.closed = False

  def drain(self, timeout):
    self.drained.append(timeout)
    return self.drains

  def adopt(self, size, *, turns, alive):
    self.adopted.append((size, turns, alive))
    self.pids = self.pids[:size] + [self.pids[0] + 5 + i for i in range(size - len(self.pids))]

  def close(self):
    self.closed = True


def key(*, tenant=None, pipeline="rows", seed=0, kwargs=None, rows=((0, 4),), arena=0,
        roots=data_roots.ANYWHERE, code_hash="abc", data=None):
  spec = producer.Spec(global_batch_size=8, ranges=rows, seed=seed, num_epochs=None,
                       shard_index=0, shard_count=1, start={}, workers=2)
  feed = kept_lib.FeedKey.of(tenant=tenant, pipeline=pipeline, code_hash=code_hash,
                             kwargs=codec.encode(kwargs or {}), spec=spec, data=data)
  return idle_lib.WorkKey.of(feed, roots=roots, arena=arena)


def idle_workers(tenancy=None, *, grace=60.0, limit=64):
  """A store of idle workers (at most ``limit`` processes: the default is this host's CPUs)."""
  return contextlib.closing(idle_lib.IdleWorkers(tenancy, grace=grace, limit=limit))


@pytest.fixture
def store():
  with idle_workers() as store:
    yield store


def run(store, k, group=None, *, session="w1", size=2, ends=None):
  """A stream of ``k`` that uses workers (``group``, made where none is adopted) and ends
  (``ends``: raised in its block, as a stream's end or failure is); the workers it used."""
  made = group or Group(size)
  lease = store.lease(k, session=session)
  used = None
  with contextlib.suppress(Exception, GeneratorExit):
    with lease.workers(lambda: made, size=size, turns=None, alive=None) as used:
      if ends is not None:
        raise ends
  lease.close()
  return used


def test_the_next_stream_of_the_same_work_adopts_the_ended_streams_workers(store):
  first = run(store, key())
  assert store.pids() == first.pids and first.drained == [idle_lib.DRAIN_S]
  again = run(store, key(), ends=GeneratorExit())  # a rollback's: closed by its consumer
  assert again is first and first.adopted == [(2, None, None)] and not first.closed
  assert run(store, key(), ends=errors.ClosedError("gone")) is first  # its consumer died
  assert store.adopted == 2 and store.pids() == first.pids


@pytest.mark.parametrize("other", [
    dict(seed=1), dict(kwargs={"scale": 2}), dict(pipeline="rows2"), dict(code_hash="def"),
    dict(rows=((4, 8),)), dict(tenant="bob"), dict(arena=1), dict(data="other files"),
    dict(roots=data_roots.DataRoots(roots=("/data/bob",)))],
    ids=["seed", "arguments", "pipeline", "code", "rows", "tenant", "arena", "data", "roots"])
def test_nothing_is_adopted_across_another_key(store, other):
  first = run(store, key())
  second = run(store, key(**other))
  assert second is not first and not first.adopted and store.adopted == 0
  assert store.pids() == sorted(first.pids + second.pids)  # each kept for its own key


def test_a_stream_that_failed_stops_its_workers(store):
  group = run(store, key(), ends=errors.RemoteError("FeedWorkerDied", "a worker died"))
  assert group.closed and store.pids() == []


def test_workers_whose_batches_in_flight_do_not_end_are_stopped(store):
  group = run(store, key(), Group(drains=False, slowest_s=2.0))
  assert group.closed and store.pids() == []
  assert group.drained == [idle_lib.DRAIN_BATCHES * 2.0]  # three of its slowest batches


def test_grace_0_stops_them_with_their_stream():
  with idle_workers(grace=0) as store:
    group = run(store, key())
    assert group.closed and group.drained == [] and store.pids() == []


def test_they_go_at_the_graces_end_and_at_close():
  with idle_workers(grace=0.05) as store:
    group = run(store, key())
    assert eventually(lambda: group.closed) and store.pids() == []
    store.grace = 60.0
    kept = run(store, key(seed=1))
    assert store.pids() == kept.pids
  assert kept.closed  # at the store's close (the sidecar's stop)
  late = run(store, key(seed=2))  # a stream that ends after it: stopped at once
  assert late.closed and store.pids() == []
  assert not [t for t in threading.enumerate() if t.name == "sidecar-feed-idle"]


def test_at_most_max_idle_processes_stay_the_oldest_go():
  with idle_workers(limit=4) as store:
    groups = [run(store, key(seed=s)) for s in range(3)]
    assert [g.closed for g in groups] == [True, False, False]
    assert store.pids() == sorted(groups[1].pids + groups[2].pids)


def test_an_adopter_of_another_size_gets_that_many(store):
  first = run(store, key(), size=3)
  again = run(store, key(), size=2)
  assert again is first and first.adopted[0][0] == 2 and len(store.pids()) == 2


def test_workers_claimed_by_a_stream_that_never_used_them_are_idle_again(store):
  first = run(store, key())
  lease = store.lease(key(), session="w2")
  assert store.pids() == []  # its own from its start: no other stream takes them
  lease.close()
  assert store.pids() == first.pids and not first.closed
  assert run(store, key()) is first


def test_a_rollback_waits_for_the_workers_its_session_still_uses(store):
  """``Feed.seek`` closes the stream and opens the next at once: the sidecar sees the
  first end a moment after the second asked for workers."""
  ended, got = threading.Event(), []
  old = store.lease(key(), session="w1")
  with old.workers(Group, size=2, turns=None, alive=None) as first:
    def reopen():
      lease = store.lease(key(), session="w1")
      with lease.workers(Group, size=2, turns=None, alive=None) as workers:
        got.append(workers)
      lease.close()
      ended.set()
    thread = threading.Thread(target=reopen)
    thread.start()
    assert not ended.wait(0.3)  # waits (HANDOVER_S at most) for the old stream's end
  thread.join()
  assert got == [first] and store.adopted == 1


def test_another_session_does_not_wait_for_workers_in_use(store):
  lease = store.lease(key(), session="w1")
  with lease.workers(Group, size=2, turns=None, alive=None) as first:
    assert run(store, key(), session="w2") is not first  # another trainer's, at once


def test_a_waiting_stream_whose_consumer_died_ends(store):
  lease = store.lease(key(), session="w1")
  with lease.workers(Group, size=2, turns=None, alive=None):
    other = store.lease(key(), session="w1")
    with pytest.raises(errors.ClosedError, match="consumer is gone"):
      with other.workers(Group, size=2, turns=None, alive=lambda: False):
        pass


POOL = """\
tenants:
  - {name: alice, token_file: alice.token, feed_workers: 2}
  - {name: bob, token_file: bob.token}
"""


@pytest.fixture
def tenancy(tmp_path):
  for name in ("alice", "bob"):
    (tmp_path / f"{name}.token").write_text(f"token-of-{name}\n")
    os.chmod(tmp_path / f"{name}.token", 0o600)
  (tmp_path / "pool.yaml").write_text(POOL)
  os.chmod(tmp_path / "pool.yaml", 0o600)
  return tenants_lib.Tenancy(pool_file.load(str(tmp_path / "pool.yaml")))


def test_idle_workers_count_against_the_quota_and_give_way_to_a_new_feed(tenancy):
  with idle_workers(tenancy) as store:
    idle = run(store, key(tenant="alice"))
    assert tenancy.feed_counts()["alice"] == (0, 2)  # idle: no feed, 2 processes
    with store.feeding("alice", 2):  # another feed of hers: they go to make its room
      assert idle.closed and tenancy.feed_counts()["alice"] == (1, 2)
      with pytest.raises(errors.ResourceExhaustedError, match="2 feed worker processes"):
        with store.feeding("alice", 1):
          pass
    assert tenancy.feed_counts()["alice"] == (0, 0)


def test_the_adopted_workers_count_once(tenancy):
  with idle_workers(tenancy) as store:
    idle = run(store, key(tenant="alice"))
    # A stream: its lease claims them as it opens, then its feed counts them, and they are
    # idle again once it ended (its quota let go of first: StreamRunner._feed's order).
    lease = store.lease(key(tenant="alice"), session="w1")
    feeding = store.feeding("alice", 2)
    feeding.__enter__()
    workers = lease.workers(Group, size=2, turns=None, alive=None)
    assert workers.__enter__() is idle and tenancy.feed_counts()["alice"] == (1, 2)
    feeding.__exit__(None, None, None)
    workers.__exit__(None, None, None)
    lease.close()
    assert tenancy.feed_counts()["alice"] == (0, 2) and store.pids() == idle.pids


def test_workers_with_no_room_in_the_quota_are_stopped(tenancy):
  with idle_workers(tenancy) as store, \
      store.feeding("alice", 2):  # her other feed holds the quota
    group = run(store, key(tenant="alice"))
    assert group.closed and store.pids() == []


def test_a_reload_that_revokes_the_tenant_stops_them(tenancy, tmp_path):
  with idle_workers(tenancy) as store:
    alice, bob = run(store, key(tenant="alice")), run(store, key(tenant="bob"))
    (tmp_path / "pool.yaml").write_text(POOL.replace("  - {name: alice, token_file: "
                                                     "alice.token, feed_workers: 2}\n", ""))
    removed, _ = tenancy.swap(pool_file.load(str(tmp_path / "pool.yaml")))
    assert removed == ["alice"]
    assert store.release("alice") == 2  # what Server.reload does for each revoked tenant
    assert alice.closed and not bob.closed and store.pids() == bob.pids
    assert run(store, key(tenant="alice")).closed  # one that ends later is not kept
