"""Tier 1: the key-value driver's saves (plugs.SaveRunner) through the one Checkpointer
(fakes, threads as processes, no sockets): what save() does while the trainer waits (no rpc
but the copies'), and a failure's kind and host across the trainer processes."""

import concurrent.futures
import dataclasses
import errno
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt.records import ShardId, ShardRecord
from sidecar._src.controller.checkpoint import finishers as finishers_lib, plugs
from sidecar._src.controller.framework import LocalShard, NumpyArrays, SaveLeaf
from sidecar._src.core import errors
from tests.support import fake_sidecars
from tests.support.fake_sidecars import DictPeers, FakeSidecars

pytestmark = pytest.mark.unit


class Watched(FakeSidecars):
  """Counts the Status rpcs; its arenas are ``arena`` bytes."""

  def __init__(self, arena=None, **kw):
    super().__init__(**kw)
    self.arena, self.statuses = arena, 0

  def status(self, *, timeout=None):
    self.statuses += 1
    return super().status(timeout=timeout)

  def arena_size(self, host):
    return self.arena

  def empty_like(self, host, arrays):
    self.calls.append(("alloc", host, [a.shape for a in arrays]))
    return super().empty_like(host, arrays)


def checkpointer(fake):
  return fake_sidecars.checkpointer(fake)


def test_a_save_asks_no_sidecar_for_its_status_while_the_trainer_waits():
  """The fit check asked every sidecar's Status in the trainer's blocked time."""
  fake = Watched()
  with checkpointer(fake) as ckpt:
    asked = fake.statuses
    assert ckpt.save(1, {"x": np.ones(1024, np.float32)}).durable.result(30) == 1
    assert fake.statuses == asked


def test_a_state_larger_than_an_arena_fails_before_any_copy():
  fake = Watched(arena=1 << 20)
  with checkpointer(fake) as ckpt, pytest.raises(
      errors.ResourceExhaustedError, match=r"the state does not fit the arenas \(host 0 needs "
      r"2.0 MiB, its arena is 1.0 MiB\); nothing was copied"):
    ckpt.save(1, {"x": np.ones(1 << 19, np.float32)})
  assert ("stage", 0) not in fake.calls


def test_a_saves_blocks_are_allocated_in_one_request_per_host():
  """Each shard's block was one round trip on the worker socket, under the Worker's lock."""
  fake = Watched()
  state = {f"w{i}": np.full((i + 1, 2), i, np.float32) for i in range(5)}
  with checkpointer(fake) as ckpt:
    assert ckpt.save(1, state).durable.result(30) == 1
  assert [c for c in fake.calls if c[0] == "alloc"] == [
      ("alloc", 0, [(i + 1, 2) for i in range(5)])]
  staged = fake.staged[(0, "/ckpt/run/1/default")]
  assert sorted(int(a.sum()) for a in staged.values()) == [2 * i * (i + 1) for i in range(5)]


class FullDisk(FakeSidecars):
  """Host 1's part of every step fails to write: its disk is full."""

  def written(self, host, final_dir):
    if host != 1:
      return super().written(host, final_dir)
    failed = concurrent.futures.Future()
    failed.set_exception(errors.CheckpointWriteError(
        "host 1 could not write step 4: No space left on device (ENOSPC) writing "
        "/ckpt/run/4.orbax-checkpoint-tmp/default/x/0", errno=errno.ENOSPC,
        path="/ckpt/run/4.orbax-checkpoint-tmp/default/x/0", host_id=1))
    return failed


def test_a_write_failure_on_another_process_keeps_its_kind_and_host():
  fake, store, outcomes = FullDisk(hosts=(0, 1)), {}, [None, None]

  def process(p: int) -> None:
    ckpt = fake_sidecars.checkpointer(fake, hosts=[0, 1], local=[p],
                                      peers=DictPeers(store, p, 2))
    try:
      with ckpt:  # close() raises the save's failure
        ckpt.save(4, {"x": np.ones(3, np.float32)})
    except errors.SidecarError as e:
      outcomes[p] = e
  threads = [threading.Thread(target=process, args=(p,)) for p in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  for p, e in enumerate(outcomes):  # process 0 had it from the sidecars, and told process 1
    assert isinstance(e, errors.CheckpointWriteError), (p, repr(e))
    assert (e.errno, e.host_id, e.path) == (
        errno.ENOSPC, 1, "/ckpt/run/4.orbax-checkpoint-tmp/default/x/0")
    assert "No space left on device (ENOSPC)" in str(e)
  assert "the save of step 4 failed" in "".join(outcomes[1].__notes__)


class Misnumbered(NumpyArrays):
  """A user's adapter whose records number every leaf 0, or set a host themselves."""

  def __init__(self, **change):
    self.change = change

  def save_leaves(self, tree):
    return [SaveLeaf(leaf.spec, tuple(
        LocalShard(dataclasses.replace(s.record, **self.change), s.data, s.device_id)
        for s in leaf.shards)) for leaf in super().save_leaves(tree)]


@pytest.mark.parametrize("change,match", [
    ({"leaf": 0}, r"leaf 1 'b' has a shard whose record names leaf 0 \['b'\] and host None"),
    ({"host": 3}, r"leaf 0 'a' has a shard whose record names leaf 0 \['a'\] and host 3"),
], ids=["leaf-number", "host-set"])
def test_a_frameworks_wrong_record_fails_the_save_before_any_copy(change, match):
  """The adapter makes each shard's record; the save only sets its host."""
  fake = Watched()
  with fake_sidecars.checkpointer(fake, framework=Misnumbered(**change)) as ckpt, \
      pytest.raises(errors.InvalidArgumentError, match=match + r": a framework's save_leaves"):
    ckpt.save(1, {"a": np.ones(4, np.float32), "b": np.zeros(2, np.int32)})
  assert not [c for c in fake.calls if c[0] == "alloc"]


class StageThreads(FakeSidecars):
  """Records the thread each Stage is sent from (a save's finisher)."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.threads: list[threading.Thread] = []

  def stage(self, host, stage):
    self.threads.append(threading.current_thread())
    return super().stage(host, stage)


def test_saves_one_after_another_run_their_finishers_on_one_kept_thread(monkeypatch):
  """Issue 69 item 5: each save started a thread of its own, and save() waited in its
  Thread.start for it to run (0.2-0.3 ms of a 4 MiB save's 4-5 ms)."""
  monkeypatch.setattr(finishers_lib, "FINISHERS", finishers_lib.Finishers())  # none idle yet
  fake = StageThreads()
  with checkpointer(fake) as ckpt:
    for step in range(3):
      ckpt.save(step, {"x": np.ones(8, np.float32)})
      ckpt.wait()  # its finisher ended: idle again
  first, *others = fake.threads
  assert len(fake.threads) == 3 and all(t is first for t in others)
  assert first.name == finishers_lib.Finishers.IDLE_NAME and first.is_alive()  # kept, idle


def test_a_saves_host_values_are_kept_as_copies_up_to_a_bound(monkeypatch):
  """A save keeps its host values for a rollback from the devices as copies of their own
  (the trainer may change its arrays once save() returned), and none past
  NUMPY_KEEP_BYTES: each save would pay that copy (such a state rolls back from the RAM
  tier)."""
  record = ShardRecord.of(ShardId(("key",), ((0, 2),)), 0, np.zeros(2, np.uint32))
  value = np.array([6, 7], np.uint32)
  [(kept_record, kept)] = plugs.kept_numpy_values([(record, value)])
  value[:] = 99
  assert kept_record is record and kept.tolist() == [6, 7]
  monkeypatch.setattr(plugs, "NUMPY_KEEP_BYTES", value.nbytes - 1)
  assert plugs.kept_numpy_values([(record, value)]) == ()
