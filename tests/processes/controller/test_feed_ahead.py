"""Tier 3: a feed that keeps batches ahead on the devices (FeedOptions.device_prefetch).

On an accelerator its own thread puts the next batches on the devices while the trainer
computes; on CPU devices it is off by default (a batch aliases its arena blocks), so
these tests turn it on to run the same thread here: the same batches in the same order,
the state of what the trainer took (not what was made ahead), the end of an epoch and a
pipeline's error after every batch before them, a small arena, close and a lost host.
"""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.support import feed_fns

pytestmark = pytest.mark.processes

FNS = ["tests.support.feed_fns"]


def data_sharding(num_devices: int) -> NamedSharding:
  return NamedSharding(Mesh(np.array(jax.devices()[:num_devices]), ("data",)), P("data"))


def ahead(n: int) -> sidecar.FeedOptions:
  return sidecar.FeedOptions(device_prefetch=n)


def ahead_threads() -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name.startswith("sidecar-feed-")]


@pytest.fixture(scope="module")
def cluster2():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB",
                                    imports=FNS) as c:
    yield c


def test_same_batches_in_the_same_order_and_the_epoch_ends_after_the_last(cluster2):
  kw = dict(kwargs={"n": 64}, global_batch_size=8, sharding=data_sharding(2), seed=3,
            num_epochs=2)
  with cluster2.controller() as ctl:
    runs = {}
    for depth in (0, 1, 3):
      with ctl.feed("ids", options=ahead(depth), **kw) as feed:
        runs[depth] = [np.asarray(b["id"]).tolist() for b in feed]
        assert feed.stats()["batches"] == 16
    assert runs[1] == runs[0] and runs[3] == runs[0] and len(runs[0]) == 16
    assert sorted(sum(runs[0][:8], [])) == list(range(64))
  assert not ahead_threads()


def test_state_is_what_the_trainer_took_and_resumes_exactly(cluster2):
  kw = dict(kwargs={"n": 256}, global_batch_size=8, sharding=data_sharding(2), seed=1)
  with cluster2.controller() as ctl:
    with ctl.feed("ids", options=ahead(4), **kw) as feed:
      first = [np.asarray(next(feed)["id"]).tolist() for _ in range(3)]
      state = feed.state()  # the thread has made batches 4-7 meanwhile
      assert (state["kind"], state["epoch"], state["position"]) == ("map", 0, 24)
      rest = [np.asarray(next(feed)["id"]).tolist() for _ in range(4)]
    with ctl.feed("ids", options=ahead(4), state=state, **kw) as feed:
      assert [np.asarray(next(feed)["id"]).tolist() for _ in range(4)] == rest
    with ctl.feed("ids", options=ahead(0), **kw) as feed:
      assert [np.asarray(next(feed)["id"]).tolist() for _ in range(7)] == first + rest


def test_a_pipeline_error_comes_after_every_batch_before_it(cluster2):
  with cluster2.controller() as ctl, ctl.feed(
      "fails_at", kwargs={"at": 6}, global_batch_size=2, sharding=data_sharding(2),
      options=ahead(4)) as feed:
    got = []
    with pytest.raises(sidecar.RemoteError, match="ValueError: bad example 6") as info:
      for _ in range(30):
        got.extend(np.asarray(next(feed)["id"]).tolist())
    assert "raise ValueError" in info.value.remote_traceback
    assert 6 not in got and len(got) >= 2  # the batches the hosts made before it arrived
    with pytest.raises(sidecar.ClosedError):
      next(feed)
  assert not ahead_threads()


def test_rows_bit_exact_under_a_small_arena_with_batches_ahead():
  # 1 MiB rows, batch 2 per host: every made-ahead batch holds its blocks, so the arena
  # is reused all the time while the trainer keeps a few batches too.
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="24MiB",
                                    imports=FNS) as c, c.controller() as ctl:
    with ctl.feed("marked_rows", kwargs={"nbytes": 1 << 20}, global_batch_size=2,
                  sharding=data_sharding(1), options=ahead(3)) as feed:
      kept = []
      for step in range(40):
        batch = next(feed)
        rows = np.asarray(batch["x"])
        for r, i in zip(rows, np.asarray(batch["i"]).tolist()):
          assert (r == feed_fns.marked_row(i, 1 << 20)).all(), f"step {step}, row {i}"
        kept = (kept + [batch])[-3:]  # the trainer keeps the last few batches alive
      for batch in kept:  # nothing they read was reused under them
        for r, i in zip(np.asarray(batch["x"]), np.asarray(batch["i"]).tolist()):
          assert (r == feed_fns.marked_row(i, 1 << 20)).all()


def test_close_stops_the_thread_while_it_waits_for_room(cluster2):
  with cluster2.controller() as ctl:
    feed = ctl.feed("ids", global_batch_size=4, sharding=data_sharding(2), options=ahead(2))
    next(feed)
    assert ahead_threads()
    feed.close()
    assert not ahead_threads()
    with pytest.raises(sidecar.ClosedError, match="is closed"):
      next(feed)
    # a Controller closes the feeds it made, and their threads with them
    next(ctl.feed("ids", global_batch_size=4, sharding=data_sharding(2), options=ahead(2)))
  assert not ahead_threads()


def test_sidecar_death_makes_next_raise_host_lost():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB",
                                    imports=FNS) as c, c.controller() as ctl:
    with ctl.feed("ids", global_batch_size=4, sharding=data_sharding(2),
                  options=ahead(2)) as feed:
      taken = next(feed)
      want = np.array(taken["x"])
      c.kill(1)
      with pytest.raises(sidecar.HostLostError, match="host 1"):
        for _ in range(50):
          next(feed)
      # what the trainer took stays valid: its blocks are the trainer's mapping's
      np.testing.assert_array_equal(np.asarray(taken["x"]), want)
      assert (want[:, 0] == np.asarray(taken["id"])).all()
  assert not ahead_threads()
