"""Tier 1: the save protocol's phases (save_protocol.SaveProtocol), which one save step
(save_run.SaveRun) calls for JAX's and PyTorch's saves alike, against an in-process fake of
the sidecars; the one stager's lots (staging.Lots, copy_in); what an abort that fails on
some hosts logs (save_protocol.on_each)."""

import concurrent.futures
import queue
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt.dcp import DcpPart, Item, ItemKind
from sidecar._src.ckptfmt.records import ShardId, ShardRecord
from sidecar._src.ckptfmt.registry import DCP, DEFAULT, ORBAX
from sidecar._src.controller.checkpoint import staging
from sidecar._src.controller.checkpoint.save_protocol import SaveProtocol, on_each
from sidecar._src.controller.checkpoint.target import Target
from sidecar._src.controller.framework import DeviceCopy
from sidecar._src.core import errors
from tests.support.fake_sidecars import FakeSidecars
from tests.support.staged import staged

pytestmark = pytest.mark.unit

ORBAX_FORMAT, DCP_FORMAT = DEFAULT.get(ORBAX), DEFAULT.get(DCP)


def begun(step: int) -> Target:
  """Step ``step`` of /ckpt as its sidecar's begin answered it."""
  return Target.for_step(ORBAX_FORMAT, "/ckpt", step).begun(f"/ckpt/{step}.orbax-checkpoint-tmp")


def dcp_begun(step: int) -> Target:
  """DCP's checkpoint /ckpt/``step`` as its sidecar's begin answered it."""
  return Target.for_step(DCP_FORMAT, f"/ckpt/{step}", step, directory="/ckpt").begun(
      f"/ckpt/{step}.dcp-checkpoint-tmp")


class Recording(FakeSidecars):
  """Records what each phase was given, format parts too."""

  def __init__(self, hosts):
    super().__init__(hosts)
    self.sent: list[tuple] = []

  def stage(self, host, *, leaves, shards, last, writers=1, extra=None, **kw):
    self.sent.append(("stage", host, len(shards), last, writers, extra))
    return self._phase("stage", host, 0)

  def abort(self, host, tmp_dir, final_dir, *, timeout):
    self.sent.append(("abort", host, tmp_dir))
    return self._phase("abort", host)

  def committed(self, host, final_dir, manifest_json=""):
    self.sent.append(("committed", host, manifest_json))
    return self._phase("committed", host, [])


def test_a_host_first_lot_carries_the_format_extra_and_its_later_ones_the_rest():
  fake = Recording([0, 1])
  protocol = SaveProtocol(client=fake, directory="/ckpt", format="dcp", writers={0: [0, 1]})
  target = dcp_begun(7)
  first = DcpPart(1, (Item(fqn="w", kind=ItemKind.BYTES, nbytes=3),))
  rest = DcpPart(1, ())
  parts: queue.SimpleQueue = queue.SimpleQueue()
  shard = staged(("w",), 0, (), np.zeros(3, np.uint8), rank=1)
  for host, last in ((0, False), (1, True), (0, True)):
    parts.put(staging.Lot(host, (shard,), last))
  protocol.stage(target, parts, hosts=[0, 1], extra=first, rest=rest)
  assert fake.sent == [("stage", 0, 1, False, 2, first), ("stage", 1, 1, True, 1, first),
                       ("stage", 0, 1, True, 2, rest)]


def test_staging_fails_with_the_error_the_copy_put_in_its_parts():
  fake = Recording([0])
  protocol = SaveProtocol(client=fake, directory="/ckpt", format=ORBAX)
  parts: queue.SimpleQueue = queue.SimpleQueue()
  staging.Lots([0], parts.put).fail(KeyboardInterrupt())
  with pytest.raises(KeyboardInterrupt):
    protocol.stage(begun(3), parts, hosts=[0])
  assert fake.sent == []


@pytest.mark.parametrize("target, removed", [
    (begun(3), ["/ckpt/3.orbax-checkpoint-tmp/default", "/ckpt/3.orbax-checkpoint-tmp"]),
    (dcp_begun(3),
     ["/ckpt/3.dcp-checkpoint-tmp"]),
], ids=["orbax-step", "dcp-checkpoint"])
def test_an_abort_drops_the_part_on_each_host_then_the_whole_uncommitted_step(target, removed):
  fake = Recording([0, 1])
  SaveProtocol(client=fake, directory="/ckpt", format=ORBAX).abort(target, [0, 1])
  by_host = {h: [t for phase, host, t in fake.sent if host == h] for h in (0, 1)}
  assert by_host == {0: removed, 1: removed}


def test_an_abort_removes_the_tmp_step_only_through_the_hosts_that_answered():
  fake = Recording([0])  # host 1 is lost: its part stays until its writer gives up
  SaveProtocol(client=fake, directory="/ckpt", format=ORBAX).abort(begun(3), [0, 1])
  item = "/ckpt/3.orbax-checkpoint-tmp/default"
  assert fake.sent == [("abort", 0, item), ("abort", 1, item),
                       ("abort", 0, "/ckpt/3.orbax-checkpoint-tmp")]


def test_a_manifest_goes_with_committed_only_where_the_format_gives_one():
  fake = Recording([0, 1])
  protocol = SaveProtocol(client=fake, directory="/ckpt", format=ORBAX)
  target = dcp_begun(3)
  protocol.mark_committed(target, [0, 1], '{"format": "dcp"}')
  protocol.mark_committed(target, [1])
  manifest = '{"format": "dcp"}'
  assert fake.sent == [("committed", 0, manifest), ("committed", 1, manifest),
                       ("committed", 1, "")]


def test_a_host_last_part_goes_with_its_last_shard_and_one_without_shards_at_the_close():
  parts: queue.SimpleQueue = queue.SimpleQueue()
  lots = staging.Lots([0, 1, 2], parts.put)
  copies = [staging.ShardCopy(record(i, h), np.full(4, i, np.int32)).with_block(
      np.empty(4, np.int32), None) for i, h in enumerate((0, 1, 0))]
  assert staging.copy_in(copies, lots) is None
  got = [parts.get_nowait() for _ in range(parts.qsize())]
  assert [(p.host, [s.record.leaf for s in p.shards], p.last) for p in got] == [
      (1, [1], True), (0, [0, 2], True), (2, [], True)]
  assert [int(s.data[0]) for s in got[1].shards] == [0, 2]  # copied into their blocks


def record(leaf: int, host: int) -> ShardRecord:
  """Leaf ``leaf``'s shard of 4 int32 on ``host``."""
  return ShardRecord(ShardId((f"l{leaf}",), ((0, 4),)), leaf, host, "int32", (4,), 16)


class Landing(DeviceCopy):
  """A shard still on its way from a device: lands when ``go`` is set, on the thread
  that takes it (recorded), or fails."""

  def __init__(self, value: int, go: threading.Event, takers: list, fail: bool = False):
    self.shape, self.dtype = (4,), np.dtype(np.int32)
    self.value, self.go, self.takers, self.fail = value, go, takers, fail

  def result(self) -> np.ndarray:
    self.go.wait(10)
    self.takers.append(threading.get_ident())
    if self.fail:
      raise RuntimeError("the device lost the copy")
    return np.full(4, self.value, np.int32)


def test_late_copies_of_every_save_go_in_turn_on_the_one_stager_thread_kept_between_them():
  # A thread made for each save starts on a fresh malloc arena, whose pages each device
  # piece's host buffer faults in anew (on gVisor: 0.28-0.38 s a GiB against 0.17 s).
  go, takers = threading.Event(), []
  saves = []
  for value, fail in ((1, False), (2, True), (3, False)):
    parts: queue.SimpleQueue = queue.SimpleQueue()
    lots = staging.Lots([0], parts.put)
    copy = staging.ShardCopy(record(0, 0), Landing(value, go, takers, fail)).with_block(
        np.zeros(4, np.int32), None)
    saves.append((parts, staging.copy_in([copy], lots)))
  assert staging.STAGER.busy and not any(done.wait(0) for _, done in saves)
  go.set()
  for _, done in saves:
    assert done.wait(10)
  assert not staging.STAGER.busy
  assert len(takers) == 3 and len(set(takers)) == 1  # one thread, kept
  assert takers[0] != threading.get_ident()
  first, failed, third = (parts.get_nowait() for parts, _ in saves)
  assert first.last and int(first.shards[0].data[0]) == 1
  assert isinstance(failed, RuntimeError)  # that save fails; the next still copies
  assert third.last and int(third.shards[0].data[0]) == 3


def test_an_abort_a_lost_host_misses_says_calmly_what_happens_next(caplog):
  fake = Recording([0])  # host 1 is lost
  with caplog.at_level("INFO"):
    SaveProtocol(client=fake, directory="/ckpt", format=ORBAX).abort(begun(19), [0, 1])
  (record,) = [r for r in caplog.records if "step 19" in r.getMessage()]
  # Issue 55 item 7: the elastic example's first line was a warning, "could not abort step
  # 19 on host 1: host 1 is lost; step 19 was not saved ...", for the case it demonstrates.
  assert record.levelname == "INFO"
  assert record.getMessage() == (
      "step 19 is not saved, as expected when a host is lost during a save: it was never "
      "committed, so the job goes on from the last committed step (an elastic retry "
      "restores that one); the lost host's part is swept at the directory's next open() "
      "(host 1: host 1 is lost)")


def test_an_abort_a_live_host_refuses_still_warns_that_the_step_was_not_saved(caplog):
  fake = Recording([0, 1])
  fake.fail["abort"] = errors.CheckpointWriteError("disk on fire")
  SaveProtocol(client=fake, directory="/ckpt", format=ORBAX).abort(begun(19), [0, 1])
  records = [r for r in caplog.records if "could not abort" in r.getMessage()]
  assert [r.levelname for r in records] == ["WARNING", "WARNING"]
  assert records[0].getMessage().startswith("could not abort step 19 on host 0: disk on "
                                            "fire; step 19 was not saved (never committed")


def test_a_step_never_begun_is_aborted_on_no_sidecar():
  """Its tmp directory comes from begin's answer: none was given, none is removed."""
  fake = Recording([0])
  SaveProtocol(client=fake, directory="/ckpt", format=ORBAX).abort(
      Target.for_step(ORBAX_FORMAT, "/ckpt", 4), [0])
  assert fake.sent == []


def test_a_host_that_could_not_abort_is_logged_as_text_not_as_its_error(caplog):
  # A handler that keeps records (pytest's, a MemoryHandler) would otherwise keep the
  # error's traceback, its frames and the arrays in them (arena blocks) alive.

  def start(h):
    if h == 0:
      raise errors.HostLostError("host 0 is lost", host_id=0)
    f = concurrent.futures.Future()
    f.set_exception(errors.HostLostError("host 1 went away", host_id=1))
    return f

  with caplog.at_level("WARNING"):
    assert on_each(start, hosts=[0, 1], what="abort step 3") == []
  assert [r.getMessage() for r in caplog.records] == [
      "could not abort step 3 on host 0: host 0 is lost",
      "could not abort step 3 on host 1: host 1 went away"]
  assert not any(isinstance(a, BaseException) for r in caplog.records for a in r.args)
