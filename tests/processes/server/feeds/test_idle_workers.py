"""Tier 3: a feed's worker processes outlive its stream, idle, for the next stream of the same
work (``server/feeds/idle.py``). After a rollback (``Feed.seek``) and after a trainer restarted
beside the same sidecar, the batches after the kept ones are made by the same processes (no
new one starts), bit for bit those of an uninterrupted feed; a feed of another seed or other
arguments starts its own; idle workers go at the grace's end, with the sidecar's stop and
with a sidecar killed by SIGKILL; a pool tenant's feed (in its own process) keeps none yet.
The sidecar is in this process (but the last test's), its feed workers real processes.

Before (main): every stream started its workers anew (the pids differed after a rollback).
"""

import os

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.arena import shm
from sidecar._src.server.feeds import processes, producer
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb
from tests.conftest import alive, eventually
from tests.support import feed_fns
from tests.support.feed_restarts import TENANT_CHILD, feed_workers
from tests.support.pool_files import ALICE, write_pool

pytestmark = pytest.mark.processes

FNS = ("tests.support.feed_fns",)
BATCH = 4
ROWS = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


@pytest.fixture
def serve(make_server):
  def serve(**kw):
    reg = registry_lib.Registry()
    for name in ("ids", "slow_ids"):
      reg.add(registry_lib.PIPELINE, name, getattr(feed_fns, name))
    kw.setdefault("shm_size", 16 << 20)
    return make_server(registry=reg, imports=FNS, device_ids=(0,), **kw)
  return serve


def controller(server, **kw):
  return sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=30, **kw)


def open_feed(ctl, name="slow_ids", *, state=None, seed=0, workers=2, n=4096):
  return ctl.feed(name, global_batch_size=BATCH, sharding=ROWS, state=state, seed=seed,
                  kwargs={"n": n}, options=sidecar.FeedOptions(workers=workers))


def take(feed, n):
  """The next ``n`` batches' ids, as lists."""
  return [np.asarray(next(feed)["id"]).tolist() for _ in range(n)]


def mine() -> list[int]:
  """The feed worker processes of this process's sidecars, running."""
  return feed_workers(os.getpid())


def test_a_rollback_is_served_by_the_same_workers_bit_for_bit(serve, tmp_path):
  server = serve()
  with controller(server) as ctl, ctl.checkpointer(str(tmp_path / "ck")) as ckpt, \
      open_feed(ctl) as feed:
    take(feed, 3)
    saved = feed.state()
    ckpt.save(3, {"w": np.zeros(4, np.float32)}, data_state=saved)
    first = take(feed, 4)
    pids = mine()
    assert len(pids) == 2
    feed.seek(saved)  # its workers busy ahead (slow_ids): what they make now is dropped
    again = take(feed, 10)  # 4 kept, then 6 made after them
    assert mine() == pids  # no process started for the batches after the kept ones
  assert again[:4] == first
  assert server.kept_batches.served >= 4 and server.idle_workers.adopted == 1
  with controller(server) as ctl, open_feed(ctl) as feed:  # an uninterrupted feed's batches
    assert take(feed, 13)[3:] == again


def test_a_restarted_trainer_is_served_by_the_same_workers(serve, tmp_path):
  server = serve()
  with controller(server) as ctl, ctl.checkpointer(str(tmp_path / "ck")) as ckpt, \
      open_feed(ctl) as feed:
    take(feed, 2)
    saved = feed.state()
    ckpt.save(2, {"w": np.zeros(4, np.float32)}, data_state=saved)
    first = take(feed, 5)
    pids = mine()
  # Its trainer gone (a new one starts in seconds), its workers are idle, its key's.
  assert eventually(lambda: server.idle_workers.pids() == pids)
  with controller(server) as ctl, open_feed(ctl, state=saved) as feed:  # a new session
    again = take(feed, 9)
    assert mine() == pids and server.idle_workers.pids() == []
  assert again[:5] == first and server.idle_workers.adopted == 1
  assert eventually(lambda: server.idle_workers.pids() == pids)
  with controller(server) as ctl, open_feed(ctl) as feed:
    assert take(feed, 11)[2:] == again


def test_a_feed_of_another_seed_or_arguments_starts_workers_of_its_own(serve):
  server = serve()
  with controller(server) as ctl:
    for other in ({}, {"seed": 1}, {"n": 4000}):
      idle = server.idle_workers.pids()
      with open_feed(ctl, "ids", workers=1, **other) as feed:
        take(feed, 2)
        started = [p for p in mine() if p not in idle]
      assert len(started) == 1  # its own: none of those idle was adopted
      assert eventually(lambda p=started[0]: p in server.idle_workers.pids())
  assert server.idle_workers.adopted == 0


def test_idle_workers_go_at_the_graces_end_and_at_the_sidecars_stop(serve):
  server = serve(feed_idle_s=0.5)
  with controller(server) as ctl:
    with open_feed(ctl, "ids", workers=1) as feed:
      take(feed, 1)
      pids = mine()
    assert eventually(lambda: not any(map(alive, pids)), timeout=10)
    assert mine() == [] and server.idle_workers.pids() == []
    server.idle_workers.grace = 60.0
    with open_feed(ctl, "ids", workers=1) as feed:
      take(feed, 1)
      pids = mine()
    assert eventually(lambda: server.idle_workers.pids() == pids)
  server.stop()
  assert not any(map(alive, pids))


def test_a_pool_tenant_s_feed_workers_stop_with_their_feed_none_kept_idle_yet(serve, tmp_path):
  """A pool tenant's feed runs in its own process, which alone knows its data identity: its
  ended feed keeps no idle workers (ARCHITECTURE.md, "Tenant processes"). Its workers are
  its process's, stopped with their feed, and give its ``feed_workers`` back to its next
  feed. (The store's own rules for a pool's tenants, a reload that revokes one included,
  are tests/unit/server/feeds/test_idle.py's.)"""
  path = write_pool(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                              "checkpoint_roots: [alice], feed_workers: 1}\n"
                              "  - {name: bob, token_file: bob.token}\n")
  server = serve(pool=path)
  with controller(server, token=ALICE) as ctl:
    for seed in (0, 1):  # her quota: 1, the second feed's once the first one's stopped
      with open_feed(ctl, "ids", workers=1, seed=seed) as feed:
        take(feed, 1)
        pids = feed_workers(os.getpid(), TENANT_CHILD)
        assert len(pids) == 1 and mine() == []
      assert eventually(lambda pids=pids: not any(map(alive, pids)))
      assert server.idle_workers.pids() == []


def test_idle_workers_end_with_a_sidecar_killed_by_sigkill():
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=list(FNS)) as cluster:
    with cluster.controller() as ctl, open_feed(ctl, "ids", workers=1) as feed:
      take(feed, 1)
    pid = cluster.pid(0)
    with cluster.controller(attach=False) as ctl:
      assert eventually(lambda: not ctl.status()[0].feeds)
    idle = feed_workers(pid)
    assert len(idle) == 1
    cluster.kill(0)
    assert eventually(lambda: not any(map(alive, idle)), timeout=10), idle


def test_drained_workers_serve_the_next_feed_and_drop_what_was_in_flight():
  """``FeedProcesses.drain``, then ``adopt``: the batches sent before are waited for (not
  made again later), and the next feed's tasks are answered by the same processes."""
  arena = shm.Arena.create(1 << 20)
  spec = pb.FeedSpec(global_batch_size=2, rows=[pb.RowRange(start=0, stop=2)], shard_count=1,
                     workers=1)
  order = producer.Order(grain.MapDataset.range(64), 0)
  n = 0

  def blocks():  # a batch's output arrays in the arena: ids, x (the element's leaves)
    nonlocal n
    n += 1
    return [[arena.view(n * 8192, 16).view(np.int64)],
            [arena.view(n * 8192 + 4096, 32).view(np.float32).reshape(2, 4)]]

  try:
    with processes.FeedProcesses(1, arena=arena, imports=FNS, name="slow_ids", spec=spec,
                                 kwargs=codec.encode({"n": 64, "delay": 0.05})) as workers:
      pids = workers.pids
      old = [blocks() for _ in range(3)]
      for i, out in enumerate(old):
        workers.submit((0, 2 * i), out)
      assert workers.drain(10.0)  # the 3 batches made and answered; their answers dropped
      for i, out in enumerate(old):
        assert out[0][0].tolist() == order.rows(0, 2 * i, ((0, 2),))
        out[0][0][:] = -1
      workers.adopt(1, turns=None, alive=None)
      new = blocks()
      workers.wait(workers.submit((0, 6), new))
      assert new[0][0].tolist() == order.rows(0, 6, ((0, 2),))
      assert all((out[0][0] == -1).all() for out in old)  # none written since the drain
      assert workers.pids == pids
  finally:
    arena.close()
