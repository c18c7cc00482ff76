"""Tier 3: ctl.feed on LocalClusters: determinism, resume (also on another host count), errors."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.conftest import eventually
from tests.support import feed_fns

pytestmark = pytest.mark.processes

FNS = ["tests.support.feed_fns"]


def data_sharding(num_devices: int) -> NamedSharding:
  return NamedSharding(Mesh(np.array(jax.devices()[:num_devices]), ("data",)), P("data"))


@pytest.fixture(scope="module")
def cluster4():
  with sidecar.testing.LocalCluster(num_hosts=4, devices_per_host=1, shm_size="32MiB",
                                    imports=FNS) as c:
    yield c


def take(feed, n):
  return [np.asarray(next(feed)["id"]).tolist() for _ in range(n)]


def test_batches_are_global_arrays_on_the_sharding_without_copies(cluster4):
  with cluster4.controller() as ctl, ctl.feed("ids", kwargs={"n": 64}, global_batch_size=8,
                                              sharding=data_sharding(4)) as feed:
    batch = next(feed)
    assert batch["x"].shape == (8, 4) and batch["x"].dtype == np.float32
    assert batch["x"].sharding == data_sharding(4)
    for shard in batch["x"].addressable_shards:
      host = shard.device.id  # one device per host
      buf = ctl.worker(host).arena.buffer
      start = buf.ctypes.data
      assert start <= shard.data.unsafe_buffer_pointer() < start + buf.nbytes  # aliases the arena
      np.testing.assert_array_equal(np.asarray(shard.data)[:, 0], np.asarray(batch["id"])[
          shard.index[0]])


def test_same_seed_same_batches_and_every_example_once_per_epoch(cluster4):
  with cluster4.controller() as ctl:
    runs = []
    for _ in range(2):
      with ctl.feed("ids", kwargs={"n": 64}, global_batch_size=8, sharding=data_sharding(4), seed=7,
                    num_epochs=1) as feed:
        runs.append([np.asarray(b["id"]).tolist() for b in feed])
    assert runs[0] == runs[1] and len(runs[0]) == 8
    assert sorted(sum(runs[0], [])) == list(range(64))
    with ctl.feed("ids", kwargs={"n": 64}, global_batch_size=8, sharding=data_sharding(4),
                  seed=8) as feed:
      assert take(feed, 8) != runs[0]


def test_state_reflects_what_was_consumed_not_prefetched(cluster4):
  with cluster4.controller() as ctl, ctl.feed("ids", kwargs={"n": 64}, global_batch_size=8,
                                              sharding=data_sharding(4),
                                              options=sidecar.FeedOptions(prefetch=4)) as feed:
    assert feed.state()["kind"] == "start"
    next(feed)
    state = feed.state()
    assert json.loads(json.dumps(state)) == state
    assert (state["kind"], state["epoch"], state["position"]) == ("map", 0, 8)
    stats = feed.stats()
    assert stats["batches"] == 1 and stats["wait_s_mean"] >= 0 and stats["hosts"] == [0, 1, 2, 3]
    assert set(stats["arena_occupancy"]) == {0, 1, 2, 3}
    assert all(0 < v < 1 for v in stats["arena_occupancy"].values())  # prefetched batches


def test_resume_with_new_controller_and_new_sidecars_continues_exactly():
  def run(state=None, n_batches=6):
    with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB",
                                      imports=FNS) as c, c.controller() as ctl:
      with ctl.feed("ids", kwargs={"n": 40}, global_batch_size=4, sharding=data_sharding(2), seed=3,
                    state=state) as feed:
        return take(feed, n_batches), feed.state()

  whole, _ = run(n_batches=14)  # crosses into the second epoch
  first, state = run(n_batches=5)
  rest, _ = run(state=state, n_batches=9)
  assert first + rest == whole


def test_resume_on_fewer_hosts_neither_repeats_nor_skips(cluster4):
  with cluster4.controller() as ctl:
    with ctl.feed("ids", kwargs={"n": 120}, global_batch_size=12, sharding=data_sharding(4), seed=1,
                  num_epochs=1) as feed:
      seen = sum(take(feed, 4), [])
      state = feed.state()
  with sidecar.testing.LocalCluster(num_hosts=3, devices_per_host=1, shm_size="16MiB",
                                    imports=FNS) as c3, c3.controller() as ctl:
    with ctl.feed("ids", kwargs={"n": 120}, global_batch_size=12, sharding=data_sharding(3), seed=1,
                  num_epochs=1, state=state) as feed:
      seen += sum((np.asarray(b["id"]).tolist() for b in feed), [])
  assert sorted(seen) == list(range(120))


def test_iterable_pipeline_shards_and_resumes_on_the_same_host_count(cluster4):
  with cluster4.controller() as ctl:
    kw = dict(global_batch_size=8, sharding=data_sharding(4), kwargs={"n": 64})
    with ctl.feed("shard_ids", num_epochs=1, **kw) as feed:
      whole = [np.asarray(b["id"]).tolist() for b in feed]
    assert sorted(sum(whole, [])) == list(range(64))
    with ctl.feed("shard_ids", **kw) as feed:
      first = take(feed, 3)
      state = feed.state()
    assert state["kind"] == "iter" and [s["position"] for s in state["shards"]] == [6] * 4
    with ctl.feed("shard_ids", state=state, num_epochs=1, **kw) as feed:
      rest = [np.asarray(b["id"]).tolist() for b in feed]
    assert first + rest == whole
  with pytest.raises(sidecar.InvalidArgumentError, match="resumes only on the same host count"):
    with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="8MiB",
                                      imports=FNS) as c2, c2.controller() as ctl2:
      ctl2.feed("shard_ids", global_batch_size=8, sharding=data_sharding(2), state=state)


def test_pipeline_exception_reaches_next_with_the_remote_traceback(cluster4):
  with cluster4.controller() as ctl, ctl.feed("fails_at", kwargs={"at": 6}, global_batch_size=4,
                                              sharding=data_sharding(4)) as feed:
    # Example 6 lands in some batch of the first epoch; every batch before it arrives.
    with pytest.raises(sidecar.RemoteError, match="ValueError: bad example 6") as info:
      for _ in range(30):
        next(feed)
    assert "raise ValueError" in info.value.remote_traceback


@pytest.mark.parametrize("kwargs,match", [
    (dict(global_batch_size=6), r"global_batch_size 6 cannot be laid out by .*: it splits the "
                                r"batch into 4 shards; use a multiple of 4 \(4 or 8\)"),
    (dict(global_batch_size=0), r"global_batch_size must be a positive int, got 0"),
    (dict(options={"prefetch": 4}), r"options must be a sidecar.FeedOptions, got dict"),
    (dict(sharding=data_sharding(8)), r"device 4 of the sharding belongs to no sidecar"),
    (dict(sharding="data"), r"sharding must be a jax.sharding.Sharding, got str"),
    (dict(state={"version": 1, "pipeline": "other", "seed": 0}), r"state is for pipeline 'other'"),
], ids=["indivisible", "zero-batch", "options", "foreign-devices", "not-a-sharding", "state"])
def test_bad_arguments_fail_at_feed(cluster4, kwargs, match):
  args = dict(global_batch_size=8, sharding=data_sharding(4)) | kwargs
  with cluster4.controller() as ctl:
    with pytest.raises(sidecar.InvalidArgumentError, match=match):
      ctl.feed("ids", **args)
    with pytest.raises(sidecar.NotRegisteredError, match=r"no pipeline named 'nope'.*ids"):
      ctl.feed("nope", global_batch_size=8, sharding=data_sharding(4))


def test_elements_of_changing_shape_name_the_leaf(cluster4):
  with cluster4.controller() as ctl, ctl.feed("ragged", global_batch_size=8,
                                              sharding=data_sharding(4)) as feed:
    with pytest.raises(sidecar.InvalidArgumentError, match=r"element leaf \['x'\] has shape"):
      next(feed)


def test_sidecar_death_makes_next_raise_host_lost():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB",
                                    imports=FNS) as c, c.controller() as ctl:
    with ctl.feed("ids", global_batch_size=4, sharding=data_sharding(2)) as feed:
      next(feed)
      c.kill(1)
      with pytest.raises(sidecar.HostLostError, match="host 1"):
        for _ in range(10):
          next(feed)


@pytest.fixture(scope="module")
def cluster1():
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=2, shm_size="16MiB",
                                    imports=FNS) as c:
    yield c


def test_workers_give_the_same_stream(cluster1):
  kw = dict(global_batch_size=8, sharding=data_sharding(2), kwargs={"n": 96}, seed=5,
            num_epochs=1)
  ids = lambda b: np.asarray(b["id"]).tolist()
  with cluster1.controller() as ctl:
    with ctl.feed("ids", **kw) as feed:
      plain = [ids(b) for b in feed]
    # Two workers, then, resumed from a state taken while batches were in flight in them, one
    # worker: the same batches in the same order as none.
    with ctl.feed("ids", options=sidecar.FeedOptions(workers=2), **kw) as feed:
      head = [ids(next(feed)) for _ in range(5)]
      state = feed.state()
    with ctl.feed("ids", options=sidecar.FeedOptions(workers=1), state=state, **kw) as feed:
      assert head + [ids(b) for b in feed] == plain
    with pytest.raises(sidecar.InvalidArgumentError, match="workers=N needs random access"):
      next(ctl.feed("shard_ids", global_batch_size=8, sharding=data_sharding(2),
                    options=sidecar.FeedOptions(workers=2)))


def test_elements_with_lists_and_namedtuples_come_whole_from_workers_too(cluster1):
  kw = dict(global_batch_size=8, sharding=data_sharding(2), seed=1, num_epochs=1)
  with cluster1.controller() as ctl:
    runs = []
    for workers in (0, 2):
      with ctl.feed("crops", options=sidecar.FeedOptions(workers=workers), **kw) as feed:
        runs.append(list(feed))
  for plain, pooled in zip(*runs, strict=True):
    for batch in (plain, pooled):
      ids = np.asarray(batch["id"])
      np.testing.assert_array_equal(np.asarray(batch["x"][1]), -np.repeat(ids[:, None], 2, 1))
      assert type(batch["t"][1]) is feed_fns.Views and batch["t"][1].extra[0] is None
      np.testing.assert_array_equal(np.asarray(batch["t"][1].extra[1]), ids)
    np.testing.assert_array_equal(np.asarray(plain["id"]), np.asarray(pooled["id"]))


def test_a_dead_feed_worker_is_restarted_without_gap_or_duplicate(cluster1, tmp_path):
  with cluster1.controller() as ctl:
    kw = dict(global_batch_size=4, sharding=data_sharding(2), num_epochs=1)
    with ctl.feed("ids", kwargs={"n": 40}, **kw) as feed:
      plain = [np.asarray(b["id"]).tolist() for b in feed]
    with ctl.feed("dies_once", kwargs={"n": 40, "marker": str(tmp_path / "died")},
                  options=sidecar.FeedOptions(workers=2), **kw) as feed:
      pooled = [np.asarray(b["id"]).tolist() for b in feed]
    assert (tmp_path / "died").exists()
    assert pooled == plain
    assert "feed worker" in cluster1.log(0) and "died" in cluster1.log(0)


def test_feed_without_a_worker_comes_inline_over_grpc(cluster1):
  kw = dict(global_batch_size=8, sharding=data_sharding(2), kwargs={"n": 48}, seed=2,
            num_epochs=1)
  with cluster1.controller() as ctl:
    with ctl.feed("ids", **kw) as feed:
      attached = [np.asarray(b["id"]).tolist() for b in feed]
  with cluster1.controller(attach=False) as ctl:
    for workers in (0, 2):
      options = sidecar.FeedOptions(workers=workers)
      with ctl.feed("ids", options=options, **kw) as feed:
        assert [np.asarray(b["id"]).tolist() for b in feed] == attached
    # pinned blocks went back after each batch; those kept for re-done steps stay held
    assert eventually(lambda: (s := ctl.status()[0]).arena_used == s.arena_kept)
