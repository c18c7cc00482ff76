"""Tier 1: what a restore raises when a shard cannot be read, against the in-process fake."""

import concurrent.futures
import dataclasses
import threading

import numpy as np
import pytest

from sidecar._src.controller.checkpoint.checkpointer import Checkpointer, RestoreStats
from sidecar._src.controller.framework import NumpyArrays
from sidecar._src.core import errors
from tests.support.fake_sidecars import FakeSidecars, checkpointer

pytestmark = pytest.mark.unit

STATE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.int64(7)}
TARGET = {"w": np.zeros((3, 4), np.float32), "step": np.int64(0)}


def saved(framework=None, **fail) -> tuple[FakeSidecars, Checkpointer]:
  fake = FakeSidecars()
  ckpt = checkpointer(fake, framework=framework)
  assert ckpt.save(5, STATE).durable.result() == 5
  fake.fail.update(fail)
  return fake, ckpt


def test_an_arena_full_during_the_reads_is_resource_exhausted_not_lost_data():
  full = errors.ResourceExhaustedError(
      "the arena is full: 48 B asked, 0 B free of 64.0 MiB in 3 blocks after waiting 29.5 s")
  _, ckpt = saved(read=full)
  with ckpt, pytest.raises(errors.ResourceExhaustedError) as raised:
    ckpt.restore(target=TARGET)
  assert not isinstance(raised.value, errors.ShardsLostError)
  message = str(raised.value)
  assert "step 5 of /ckpt/run cannot be restored now: no arena had room for 2 of its " \
         "shards (56 B" in message
  assert "The data is intact: the arena is full: 48 B asked" in message
  assert "larger --shm-size" in message


def test_another_failure_keeps_its_kind():
  _, ckpt = saved(read=errors.DeadlineExceededError("Read on host 0 timed out"))
  with ckpt, pytest.raises(errors.DeadlineExceededError, match="Read on host 0 timed out"):
    ckpt.restore(target=TARGET)


@pytest.mark.parametrize("error", [
    errors.CorruptCheckpointError("array 'w' shard [[0, 3], [0, 4]] does not match its crc32c"),
    errors.HostLostError("host 0 is gone", host_id=0),
], ids=["checksum", "host-gone"])
def test_shards_are_lost_only_where_no_copy_is_there_or_valid(error):
  _, ckpt = saved(read=error)
  with ckpt, pytest.raises(errors.ShardsLostError, match="2 shards have no live copy"):
    ckpt.restore(target=TARGET)


class Starting(NumpyArrays):
  """Numpy arrays; each leaf's blocks go to ``on_start`` as soon as they are read."""

  def __init__(self, on_start):
    self.on_start = on_start

  def restore_target(self, target):
    return dataclasses.replace(super().restore_target(target), start=self.on_start)


def test_a_leaf_whose_shards_are_read_starts_while_the_other_reads_go_on():
  started, held, real = [], concurrent.futures.Future(), []

  def on_start(leaf, blocks):
    started.append((leaf.key_path[-1], held.done(), [b.copy() for b in blocks]))
    if not held.done():
      held.set_result(real[0].result())  # w's read lands only now
  fake, ckpt = saved(Starting(on_start))
  read = fake.read

  def read_holding_w(host, final_dir, shard, **kw):
    f = read(host, final_dir, shard, **kw)
    if shard.key_path[-1] != "w":
      return f
    real.append(f)
    threading.Timer(10, lambda: held.done() or held.set_result(f.result())).start()  # no hang
    return held
  fake.read = read_holding_w
  with ckpt:
    restored = ckpt.restore(target=TARGET)
  assert [(name, done) for name, done, _ in started] == [("step", False), ("w", True)]
  np.testing.assert_array_equal(started[1][2][0], STATE["w"])
  np.testing.assert_array_equal(restored["w"], STATE["w"])


@pytest.mark.parametrize("shards, tier", [
    ({"ram:host0": 2, "ram:host1": 1}, "ram"),
    ({"replica:host1": 3}, "replica"),
    ({"storage": 1}, "storage"),
    ({"ram:host0": 1, "storage": 1}, "mixed"),
    ({}, "none"),
], ids=["ram", "replica", "storage", "mixed", "empty"])
def test_restore_stats_name_the_tier_read(shards, tier):
  sizes = {source: 10 * n for source, n in shards.items()}
  stats = RestoreStats(step=3, seconds=0.5, shards=shards, bytes=sizes)
  assert stats.tier == tier
  assert sum(stats.tiers.values()) == sum(sizes.values())
  assert set(stats.tiers) == {source.split(":")[0] for source in shards}


def test_a_restore_from_the_ram_tier_says_so():
  _, ckpt = saved()
  with ckpt:
    ckpt.restore(target=TARGET)
    assert ckpt.last_restore_stats().tier == "ram"
