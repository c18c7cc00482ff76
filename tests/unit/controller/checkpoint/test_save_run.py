"""Tier 1: one save step (save_run.SaveRun) as DCP's hooks and the key-value finisher drive
it, against an in-process fake of the sidecars: begin, stage on the caller's thread,
the one finish (replicate, prepared, commit or abort, committed), the end."""

import concurrent.futures
import os
import signal
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt.dcp import DcpCommit, DcpPart, Item, ItemKind
from sidecar._src.ckptfmt.registry import DCP, DEFAULT
from sidecar._src.controller.checkpoint import staging
from sidecar._src.controller.checkpoint.coordination import Coordinator, KeyValue
from sidecar._src.controller.checkpoint.save_protocol import SaveProtocol, Target
from sidecar._src.controller.checkpoint.save_run import Ending, SaveHandle, SaveRun
from sidecar._src.controller.peers import LocalPeers
from sidecar._src.core import errors, interrupts
from tests.support.fake_sidecars import FakeSidecars

pytestmark = pytest.mark.unit


class Arena(FakeSidecars):
  """Blocks in host memory; records each stage call's thread; ``on_alloc`` runs when
  blocks are asked for (a Ctrl-C, say)."""

  on_alloc = staticmethod(lambda: None)

  def __init__(self, hosts):
    super().__init__(hosts)
    self.stagers: list[int] = []
    self.stage_sizes: list[tuple[int, bool]] = []

  def empty_like(self, host, arrays):
    self.on_alloc()
    return [(np.empty(a.shape, a.dtype), None) for a in arrays]

  def stage(self, host, stage):
    self.stagers.append(threading.get_ident())
    self.stage_sizes.append((len(stage.shards), stage.last))
    return super().stage(host, stage)


def items(n: int) -> tuple[Item, ...]:
  return tuple(Item(fqn=f"w{i}", kind=ItemKind.TENSOR, nbytes=16, dtype="int32",
                    sizes=(4,), offsets=(0,)) for i in range(n))


def dcp_run(fake, *, hosts=(0,), ending=None, step=3) -> SaveRun:
  """DCP's coordinator's run of /ckpt/``step``: it begins and commits over ``hosts``."""
  target = Target.for_step(DEFAULT.get(DCP), f"/ckpt/{step}", step, directory="/ckpt")
  protocol = SaveProtocol(client=fake, directory="/ckpt", format=DCP,
                          writers={h: [h] for h in hosts})
  return SaveRun(protocol, target, hosts=hosts, local=hosts,
                 placement={h: [(h + 1) % len(hosts)] for h in hosts} if len(hosts) > 1 else {},
                 bandwidth=None, coordination=Coordinator(), ending=ending,
                 share_manifest=True, path=f"/ckpt/{step}")


def copies(n: int) -> list[staging.ShardCopy]:
  """Rank 0's shards of ``items(n)`` on host 0."""
  arrays = [np.full(4, i, np.int32) for i in range(n)]
  return [staging.ShardCopy(item.record(i, 0, a, host=0), a)
          for i, (item, a) in enumerate(zip(items(n), arrays))]


def commit_extra() -> DcpCommit:
  return DcpCommit(b"pickled", {0: 48}, "{}")


def test_a_rank_copies_are_sent_in_lots_as_the_copy_goes_on_the_calling_thread(monkeypatch):
  # Before: stage_copies started a sender thread of its own for each save.
  monkeypatch.setattr(staging, "STAGE_LOT_BYTES", 8)
  fake = Arena([0])
  run = dcp_run(fake)
  run.begin()
  mine = copies(3)  # 16 bytes each: a lot each
  threads = set(threading.enumerate())
  run.stage_copies(0, mine, extra=DcpPart(0, 3))
  assert set(threading.enumerate()) <= threads
  assert set(fake.stagers) == {threading.get_ident()}
  # The last lot goes with the last shard: no empty stage call after it.
  assert fake.stage_sizes == [(1, False), (1, False), (1, True)]
  assert mine == []  # the blocks are the sidecar's now
  assert run.stats["stage_s"] >= 0


def test_ctrl_c_during_the_copy_drops_the_host_part_and_raises():
  fake = Arena([0])
  fake.on_alloc = lambda: os.kill(os.getpid(), signal.SIGINT)  # noted, not raised, here
  run = dcp_run(fake)
  run.begin()
  threads = set(threading.enumerate())
  with pytest.raises(KeyboardInterrupt), interrupts.deferred():
    run.stage_copies(0, copies(1), extra=DcpPart(0, 1))
  assert fake.stage_sizes == []  # nothing staged
  assert fake.aborted == [(0, "/ckpt/3.dcp-checkpoint-tmp")]
  assert set(threading.enumerate()) <= threads


def test_the_coordinator_run_replicates_waits_for_every_host_commits_once_and_tells_all():
  fake = Arena([0, 1])
  run = dcp_run(fake, hosts=(0, 1))
  assert run.begin().tmp_dir == "/ckpt/3.dcp-checkpoint-tmp"
  run.stage_copies(0, copies(1), extra=DcpPart(0, 1))
  fake.calls.clear()
  run.finish(extra=commit_extra())
  assert fake.calls == [("replicate", 0), ("replicate", 1), ("prepared", 0), ("prepared", 1),
                        ("commit", 0), ("info", 0), ("committed", 0), ("committed", 1)]
  manifest = fake.manifests["/ckpt/3"].to_json()
  assert fake.told == [(0, "/ckpt/3", manifest), (1, "/ckpt/3", manifest)]
  assert run.replication is not None and run.replication_error() is None


def test_a_host_that_fails_its_writes_aborts_the_step_on_every_host_and_fails_staged_too():
  fake = Arena([0, 1])
  fake.fail["prepared"] = errors.CheckpointWriteError("disk on fire")
  handle = SaveHandle(3, concurrent.futures.Future(), concurrent.futures.Future())
  run = dcp_run(fake, hosts=(0, 1), ending=Ending(handle, LocalPeers(), "k", None))
  run.begin()
  with pytest.raises(errors.CheckpointWriteError, match="disk on fire"):
    run.finish(extra=commit_extra())
  assert sorted(h for h, _ in fake.aborted) == [0, 1]
  assert ("commit", 0) not in fake.calls and fake.told == []
  assert isinstance(handle.staged.exception(), errors.CheckpointWriteError)
  run.end(handle.staged.exception())  # on this thread: durable says why
  assert isinstance(handle.durable.exception(0), errors.CheckpointWriteError)


class CommittedAtAbort(Arena):
  """Host 0's commit answers late (its deadline passed) while it goes on, and had
  committed the step by the time its abort came."""

  def abort(self, host, abort):
    aborted = super().abort(host, abort)
    if host != 0:
      return aborted
    committed: concurrent.futures.Future = concurrent.futures.Future()
    committed.set_result(abort.final_dir)
    return committed


def test_a_step_its_committer_committed_before_the_abort_came_is_left_whole_and_said_saved():
  """The host the step is committed through is asked first; it answers committed: no other
  host removes anything (its files are the committed step's), and the trainer's error says
  the step was committed all the same."""
  fake = CommittedAtAbort([0, 1])
  fake.fail["commit"] = errors.DeadlineExceededError("commit: no answer after 3600 s")
  run = dcp_run(fake, hosts=(0, 1))
  run.begin()
  with pytest.raises(errors.DeadlineExceededError, match="no answer") as raised:
    run.finish(extra=commit_extra())
  assert fake.aborted == [(0, "/ckpt/3.dcp-checkpoint-tmp")]
  assert raised.value.__notes__[-1] == (
      "step 3 was committed all the same, at /ckpt/3: host 0's commit of it had begun "
      "before the abort reached it; restores see it")


def test_a_step_committed_all_the_same_is_listed_kept_and_told_as_any_commits():
  """Its save failed, yet its abort found the step committed: the checkpointer's retention
  lists it and drops what max_to_keep no longer keeps, the RAM tiers are told it is
  committed (as a commit tells them), and the trainer's ``durable`` still fails."""
  from sidecar._src.ckptfmt.registry import ORBAX
  from sidecar._src.controller.checkpoint.retention import Retention
  fake = CommittedAtAbort([0, 1])
  fake.steps["/ckpt"] = {1, 2}
  fake.fail["commit"] = errors.DeadlineExceededError("commit: no answer after 3600 s")
  target = Target.for_step(DEFAULT.get(ORBAX), "/ckpt", 3)
  handle = SaveHandle(3, concurrent.futures.Future(), concurrent.futures.Future())
  retention = Retention(client=fake, directory="/ckpt", local=[0, 1], lead=True,
                        max_to_keep=1, keep_period=None, steps=[1, 2])
  run = SaveRun(SaveProtocol(client=fake, directory="/ckpt", format=ORBAX), target,
                hosts=[0, 1], local=[0, 1], placement={}, bandwidth=None,
                coordination=Coordinator(), ending=Ending(handle, LocalPeers(), "k", retention))
  run.begin()
  with pytest.raises(errors.DeadlineExceededError, match="no answer") as raised:
    run.finish()
  run.end(raised.value)
  assert retention.all() == [3] and fake.steps["/ckpt"] == set()
  assert fake.told == [(0, target.final_dir, ""), (1, target.final_dir, "")]
  with pytest.raises(errors.DeadlineExceededError, match="no answer"):
    handle.durable.result(0)


def test_a_key_value_run_of_one_process_begins_stages_commits_and_ends_on_its_thread():
  from sidecar._src.ckptfmt.registry import ORBAX
  from sidecar._src.controller.checkpoint.retention import Retention
  fake = Arena([0])
  target = Target.for_step(DEFAULT.get(ORBAX), "/ckpt", 5)
  protocol = SaveProtocol(client=fake, directory="/ckpt", format=ORBAX)
  handle = SaveHandle(5, concurrent.futures.Future(), concurrent.futures.Future())
  retention = Retention(client=fake, directory="/ckpt", local=[0], lead=True, max_to_keep=None,
                        keep_period=None, steps=[])
  run = SaveRun(protocol, target, hosts=[0], local=[0], placement={}, bandwidth=None,
                coordination=KeyValue(LocalPeers(), "k", [0]),
                ending=Ending(handle, LocalPeers(), "k", retention))
  assert run.begin().tmp_step == "/ckpt/5.orbax-checkpoint-tmp"
  run.finish()
  threads = set(threading.enumerate())
  run.end(None)
  assert set(threading.enumerate()) <= threads
  assert handle.durable.result(0) == 5 and retention.all() == [5]
  assert fake.told == [(0, target.final_dir, "")]  # each host built its own manifest
