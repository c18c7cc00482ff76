"""Kept batches (``server/feeds/kept.py``, ``replay.py``) against one in-process sidecar: the steps
re-done after a rollback or a restart get the batches of the first pass, bit for bit, from
the sidecar's arena without the pipeline reading their elements again; what is kept is
bounded (its count, a share of the arena, and it gives way where the arena is full), goes
at the next save, and is never served to a feed of another pipeline, arguments, seed or
layout."""

import collections

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.user import registry as registry_lib
from tests.conftest import eventually

pytestmark = pytest.mark.server

BATCH = 4
READS: list[int] = []  # every element the pipelines read, in the order read


def counted(ctx, *, scale: int = 1, width: int = 1):
  def read(i):
    READS.append(int(i))
    return {"x": np.full(width, i * scale, np.float32)}
  return grain.MapDataset.range(4096).map(read)


@pytest.fixture
def server(make_server):
  reg = registry_lib.Registry()
  reg.add("pipeline", "counted", counted)
  reg.add("pipeline", "counted2", counted)
  READS.clear()
  return make_server(registry=reg, device_ids=(0,), shm_size=16 << 20)


@pytest.fixture
def ctl(server):
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as c:
    yield c


def open_feed(ctl, name="counted", *, state=None, seed=0, batch=BATCH, replay=None,
              kwargs=None):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  options = sidecar.FeedOptions() if replay is None else sidecar.FeedOptions(replay=replay)
  return ctl.feed(name, global_batch_size=batch, sharding=sharding, state=state, seed=seed,
                  kwargs=kwargs or {}, options=options)


def take(feed, n):
  """The next ``n`` batches' ``x``, as lists."""
  return [np.asarray(next(feed)["x"]).tolist() for _ in range(n)]


def elements(batches):
  return [int(row[0]) for b in batches for row in b]


def read_twice(batches):
  """The elements of ``batches`` the pipeline read more than once."""
  counts = collections.Counter(READS)
  return [e for e in elements(batches) if counts[e] > 1]


def test_a_rollback_is_served_the_first_pass_batches_without_reading_them_again(ctl, tmp_path):
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    take(feed, 3)
    saved = feed.state()
    ckpt.save(3, {"w": np.zeros(4, np.float32)}, data_state=saved)
    first = take(feed, 6)
    feed.seek(saved)  # what sidecar.jax.Recovery does after it restored step 3
    again = take(feed, 6)
  assert again == first  # bit for bit (float32 values as Python floats)
  assert read_twice(first) == []


def test_a_restarted_trainer_is_served_them_too(server, tmp_path):
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl, \
      ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    take(feed, 2)
    saved = feed.state()
    ckpt.save(2, {"w": np.zeros(4, np.float32)}, data_state=saved)
    first = take(feed, 5)
  # A new trainer process: a new worker session, the same sidecar.
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl, \
      open_feed(ctl, state=saved) as feed:
    again = take(feed, 8)
  assert again[:5] == first
  assert read_twice(first) == []
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl, \
      open_feed(ctl) as feed:  # and what it made after them is the uninterrupted run's
    assert take(feed, 10)[2:] == again


def test_the_batches_before_a_save_go_at_the_save(server, ctl, tmp_path):
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    take(feed, 5)
    assert server.kept_batches.positions()[:5] == [(0, 0), (0, 4), (0, 8), (0, 12), (0, 16)]
    ckpt.save(5, {"w": np.zeros(4, np.float32)}, data_state=feed.state())
    take(feed, 1)  # the save is told with the next credit
    assert eventually(lambda: server.kept_batches.positions()[0] == (0, 20))
    ckpt.save(6, {"w": np.zeros(4, np.float32)}, data_state=feed.state())
    take(feed, 1)
    assert eventually(lambda: server.kept_batches.positions()[0] == (0, 24))
    # A save with another feed's state (or none of ours) drops nothing of this one's.
    with open_feed(ctl, seed=1) as other:
      take(other, 1)
      ckpt.save(7, {"w": np.zeros(4, np.float32)}, data_state=other.state())
    ckpt.save(8, {"w": np.zeros(4, np.float32)}, data_state={"epoch": 0, "position": 400})
    ckpt.save(9, {"w": np.zeros(4, np.float32)})
    take(feed, 3)
    assert server.kept_batches.positions(replay_key(server, seed=0))[0] == (0, 24)


def replay_key(server, *, seed):
  """The key of this module's "counted" feeds of ``seed`` that the sidecar keeps batches of."""
  keys = [k for k in server.kept_batches._kept if k.seed == seed and k.pipeline == "counted"]
  assert len(keys) == 1, keys
  return keys[0]


def test_no_more_than_replay_batches_are_kept_the_oldest_since_the_save(server, ctl):
  with open_feed(ctl, replay=3) as feed:
    first = take(feed, 8)
    assert server.kept_batches.positions() == [(0, 0), (0, 4), (0, 8)]
    feed.seek(None)
    again = take(feed, 8)
  assert again == first
  counts = collections.Counter(READS)
  assert [counts[e] for e in elements(first)] == [1] * 12 + [2] * 20


def test_replay_0_keeps_none(server, ctl):
  with open_feed(ctl, replay=0) as feed:
    take(feed, 4)
    assert server.kept_batches.count() == 0


def test_kept_batches_hold_at_most_a_quarter_of_the_arena(make_server):
  reg = registry_lib.Registry()
  reg.add("pipeline", "counted", counted)
  server = make_server(registry=reg, device_ids=(0,), shm_size=2 << 20)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl, \
      open_feed(ctl, kwargs={"width": 4096}) as feed:  # 64 KiB a batch
    take(feed, 12)
    assert server.kept_batches.count() == 8  # 8 x 64 KiB = a quarter of 2 MiB
    assert server.kept_batches.kept_bytes() == 8 * 64 << 10


def test_kept_batches_give_way_to_new_batches_where_the_arena_is_full(make_server):
  reg = registry_lib.Registry()
  reg.add("pipeline", "counted", counted)
  server = make_server(registry=reg, device_ids=(0,), shm_size=2 << 20)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl:
    with open_feed(ctl, kwargs={"width": 4096}) as feed:  # 64 KiB a batch
      take(feed, 8)
    assert server.kept_batches.count() == 8  # a quarter of the arena
    # 448 KiB a batch (never kept: more than a quarter), 3 or 4 of them held at once: only
    # with the kept batches gone do they fit.
    with open_feed(ctl, kwargs={"width": 28000}, seed=1) as feed:
      assert len(take(feed, 6)) == 6
    assert server.kept_batches.count() < 8


@pytest.mark.parametrize("other", [
    dict(seed=1), dict(kwargs={"scale": 2}), dict(name="counted2"), dict(batch=2 * BATCH)],
    ids=["seed", "arguments", "pipeline", "layout"])
def test_nothing_is_served_to_a_feed_that_differs(server, ctl, other):
  with open_feed(ctl) as feed:
    take(feed, 4)
  kept = server.kept_batches.count()
  READS.clear()
  with open_feed(ctl, **other) as feed:
    got = take(feed, 4)
  assert len(READS) >= 4 * len(got[0])  # its own elements, read
  assert server.kept_batches.count() >= kept  # the first feed's stay kept (its own key)
  assert server.kept_batches.served == 0


def test_a_batch_its_trainer_wrote_into_is_made_anew(make_server):
  import sidecar.torch
  reg = registry_lib.Registry()
  reg.add("pipeline", "counted", counted)
  server = make_server(registry=reg, shm_size=16 << 20)
  with sidecar.torch.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl:
    loader = sidecar.torch.DataLoader("counted", batch_size=BATCH, controller=ctl)
    it = iter(loader)
    first = [next(it)["x"].clone() for _ in range(2)]
    third = next(it)
    made = third["x"].clone()
    third["x"].add_(1000)  # in place: the arena block itself
    state = None
    loader.seek(state)
    again = [next(it)["x"] for _ in range(3)]
    loader.close()
  assert [a.tolist() for a in again[:2]] == [f.tolist() for f in first]
  assert again[2].tolist() == made.tolist()  # made anew, not the written block
  assert server.kept_batches.served == 2
