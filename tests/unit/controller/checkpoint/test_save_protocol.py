"""Tier 1: the save protocol's phases (save_protocol.SaveProtocol), which one save step
(save_run.SaveRun) calls for JAX's and PyTorch's saves alike, against an in-process fake of
the sidecars; the one stager's lots (staging.Lots, copy_in); what an abort that fails on
some hosts logs (save_protocol.on_each); where a step goes (save_protocol.Target): its
directories are its format's, its tmp ones Begin's answer and its final one the client's
own spelling, and a new format's layout needs nothing on the trainer side."""

import concurrent.futures
import json
import pathlib
import queue
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.ckptfmt.dcp import DcpPart
from sidecar._src.ckptfmt.format import Format, Uncommitted
from sidecar._src.ckptfmt.records import Manifest, SavedLeaf, ShardId, ShardRecord
from sidecar._src.ckptfmt.registry import DCP, DEFAULT, ORBAX
from sidecar._src.ckptfmt.save_values import Stage
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.controller.checkpoint import staging
from sidecar._src.controller.checkpoint.save_protocol import (
  SaveProtocol,
  Sends,
  Staging,
  Target,
  on_each,
)
from sidecar._src.controller.framework import DeviceCopy
from sidecar._src.core import errors
from tests.support.fake_sidecars import FakeSidecars, checkpointer
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
    self.committed_at: dict[int, str] = {}  # hosts whose commit an abort met, and where

  def stage(self, host, stage):
    self.sent.append(("stage", host, len(stage.shards), stage.last, stage.writers,
                      stage.extra, stage.leaves))
    return self._call("stage", host, 0)

  def abort(self, host, abort):
    self.sent.append(("abort", host, abort.tmp_dir))
    return self._call("abort", host, self.committed_at.get(host, ""))

  def committed(self, host, committed):
    self.sent.append(("committed", host, committed.manifest_json))
    return self._call("committed", host, [])


def test_each_lot_carries_the_format_extra_and_a_host_first_its_leaves():
  fake = Recording([0, 1])
  protocol = SaveProtocol(client=fake, directory="/ckpt", format="dcp", writers={0: [0, 1]})
  target = dcp_begun(7)
  part = DcpPart(1, 1)
  parts: queue.SimpleQueue = queue.SimpleQueue()
  shard = staged(("w",), 0, (), np.zeros(3, np.uint8), rank=1)
  for host, last in ((0, False), (1, True), (0, True)):
    parts.put(staging.Lot(host, (shard,), last))
  leaves = (LeafSpec(key_path=("w",), shape=(3,), dtype=np.uint8),)
  first = Stage("/ckpt", 7, target.tmp_dir, target.final_dir, leaves, extra=part)
  Sends(protocol, Staging(hosts=[0, 1], first=first)).drain(parts)
  assert fake.sent == [("stage", 0, 1, False, 2, part, leaves),
                       ("stage", 1, 1, True, 1, part, leaves),
                       ("stage", 0, 1, True, 2, part, ())]


def test_staging_fails_with_the_error_the_copy_put_in_its_parts():
  fake = Recording([0])
  protocol = SaveProtocol(client=fake, directory="/ckpt", format=ORBAX)
  parts: queue.SimpleQueue = queue.SimpleQueue()
  staging.Lots([0], parts.put).fail(KeyboardInterrupt())
  with pytest.raises(KeyboardInterrupt):
    Sends(protocol, Staging(hosts=[0], first=Stage("/ckpt", 3, "", ""))).drain(parts)
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


def test_an_abort_a_host_answers_committed_says_the_step_is_saved_and_removes_nothing(caplog):
  """A host whose commit of the step had begun when the abort came committed it: the
  abort waited and was told so; the step's directory is no tmp one any more."""
  fake = Recording([0, 1])
  fake.committed_at[0] = "/ckpt/3"
  SaveProtocol(client=fake, directory="/ckpt", format=ORBAX).abort(begun(3), [0, 1])
  item = "/ckpt/3.orbax-checkpoint-tmp/default"
  assert fake.sent == [("abort", 0, item), ("abort", 1, item)]
  (record,) = [r for r in caplog.records if "step 3" in r.getMessage()]
  assert record.levelname == "WARNING"
  assert record.getMessage() == (
      "step 3 was committed by host 0's sidecar before the abort reached it (at /ckpt/3): "
      "it is saved, and restores see it; nothing of it was removed on any host; the save's "
      "error is raised all the same")


class Answers(Recording):
  """Each host's abort answered as ``answers`` says: where it committed the step, or an
  error (the others: "", aborted)."""

  def __init__(self, hosts, answers):
    super().__init__(hosts)
    self.answers = answers

  def abort(self, host, abort):
    answer = self.answers.get(host, "")
    if not isinstance(answer, BaseException):
      self.committed_at[host] = answer
      return super().abort(host, abort)
    self.sent.append(("abort", host, abort.tmp_dir))
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(answer)
    return failed


ITEM, TMP_STEP = "/ckpt/3.orbax-checkpoint-tmp/default", "/ckpt/3.orbax-checkpoint-tmp"


@pytest.mark.parametrize("answer, sent, said", [
    ("", [("abort", 1, ITEM), ("abort", 0, ITEM), ("abort", 2, ITEM), ("abort", 1, TMP_STEP),
          ("abort", 0, TMP_STEP), ("abort", 2, TMP_STEP)], ""),
    ("/ckpt/3", [("abort", 1, ITEM)], "/ckpt/3"),
    (errors.DeadlineExceededError("abort: step 3 is still being committed after 60 s"),
     [("abort", 1, ITEM)], None),
    (errors.HostLostError("host 1 is lost", host_id=1),
     [("abort", 1, ITEM), ("abort", 0, ITEM), ("abort", 2, ITEM), ("abort", 0, TMP_STEP),
      ("abort", 2, TMP_STEP)], ""),
], ids=["not-committed", "committed", "no-answer", "committer-lost"])
def test_an_abort_asks_the_committer_first_and_removes_files_only_once_it_did_not_commit(
    answer, sent, said, caplog):
  """Every host's files lie in the step's one tmp directory, which the committer's commit
  renames: the other hosts remove them only once it said it did not commit the step (or
  its sidecar is gone); committed or not known, no host removes anything."""
  fake = Answers([0, 1, 2], {1: answer})
  got = SaveProtocol(client=fake, directory="/ckpt", format=ORBAX).abort(
      begun(3), [0, 1, 2], committer=1)
  assert (fake.sent, got) == (sent, said)
  if said is None:
    (record,) = [r for r in caplog.records if "step 3" in r.getMessage()]
    assert record.getMessage() == (
        "could not abort step 3 on host 1, which commits it: abort: step 3 is still being "
        "committed after 60 s; whether the step is committed is not known, so nothing of it "
        "is removed on any host (restores see it if its commit ends; if not, the "
        "directory's next open() sweeps its files)")


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


class Layout(Format):
  """A format's directories only: what the trainer side asks a format (its save phases are
  the sidecar's, never called here)."""

  overwrites = False

  def create_tmp(self, directory, step):
    raise AssertionError("the sidecar's")

  def is_checkpoint(self, path):
    raise AssertionError("the sidecar's")

  def numbering(self, leaves):
    raise AssertionError("the sidecar's")

  def write(self, tmp_dir, host_id, numbering, incoming, *, progress, turn):
    raise AssertionError("the sidecar's")

  def commit(self, tmp_dir, manifest, *, leaves, num_hosts, whole_step, extra, swapping):
    raise AssertionError("the sidecar's")

  def read(self, final_dir, record, *, allocate, manifest):
    raise AssertionError("the sidecar's")


class StepDirectory(Layout):
  """A step is one directory, ``<directory>/<step>``, written as ``<step>.steps-tmp`` beside
  it: no item inside (not Orbax's), begun from the root and the step (not DCP_FORMAT's)."""

  name, tmp_suffix = "steps", ".steps-tmp"

  def tmp_of(self, directory, step):
    return str(pathlib.Path(directory) / f"{step}{self.tmp_suffix}")

  def final_of(self, path):
    if not path.name.endswith(self.tmp_suffix):
      return None
    final = path.with_name(path.name.removesuffix(self.tmp_suffix))
    return Uncommitted(path, final, final)


class HiddenStaging(Layout):
  """A step is written in ``<directory>/.staging/<step>`` and committed to
  ``<directory>/<step>``; a save writes its item ``shards`` inside it."""

  name, tmp_suffix, item = "hidden", "", "shards"

  def tmp_of(self, directory, step):
    return str(pathlib.Path(directory) / ".staging" / str(step))

  def final_of(self, path):
    parts = path.parts
    if ".staging" not in parts[:-1]:
      return None
    at = parts.index(".staging")
    tmp = pathlib.Path(*parts[:at + 2])
    committed = pathlib.Path(*parts[:at]) / parts[at + 1]
    return Uncommitted(tmp, committed, committed / path.relative_to(tmp))


@pytest.mark.parametrize("fmt, begun, tmp_dir, final_dir", [
    (ORBAX_FORMAT, "/ckpt/7.orbax-checkpoint-tmp", "/ckpt/7.orbax-checkpoint-tmp/default",
     "/ckpt/7/default"),
    (StepDirectory(), "/ckpt/7.steps-tmp", "/ckpt/7.steps-tmp", "/ckpt/7"),
    (HiddenStaging(), "/ckpt/.staging/7", "/ckpt/.staging/7/shards", "/ckpt/7/shards"),
], ids=["orbax", "step-directory", "hidden-staging"])
def test_a_step_is_where_its_format_puts_it(fmt, begun, tmp_dir, final_dir):
  """Target placed Orbax's item ('default') under every format's Begin answer."""
  target = Target.for_step(fmt, "/ckpt", 7)
  assert (target.directory, target.final_dir, target.tmp_dir, target.whole_step) == (
      "/ckpt", final_dir, "", True)
  target = target.begun(begun)
  assert (target.tmp_step, target.tmp_dir, target.final_dir) == (begun, tmp_dir, final_dir)


def test_a_dcp_checkpoint_is_its_own_directory_begun_beside_it():
  target = Target.for_step(DCP_FORMAT, "/ckpt/run/3", 3, directory="/ckpt/run").begun(
      "/ckpt/run/3.dcp-checkpoint-tmp")
  assert (target.directory, target.tmp_step, target.tmp_dir, target.final_dir) == (
      "/ckpt/run", "/ckpt/run/3.dcp-checkpoint-tmp", "/ckpt/run/3.dcp-checkpoint-tmp",
      "/ckpt/run/3")


def test_the_final_directory_stays_the_clients_own_spelling(tmp_path):
  """Begin answers the resolved tmp directory; the step's final directory (the manifest's,
  the RAM tier's key, what a restore reads) is still the path the client named: through a
  symlink, or relative."""
  real = tmp_path / "real"
  real.mkdir()
  link = tmp_path / "link"
  link.symlink_to(real)
  target = Target.for_step(ORBAX_FORMAT, str(link), 5).begun(str(real / "5.orbax-checkpoint-tmp"))
  assert target.tmp_dir == str(real / "5.orbax-checkpoint-tmp" / "default")
  assert target.final_dir == str(link / "5" / "default")
  target = Target.for_step(DCP_FORMAT, str(link / "5"), 5, directory=str(link)).begun(
      str(real / "5.dcp-checkpoint-tmp"))
  assert (target.tmp_dir, target.final_dir) == (str(real / "5.dcp-checkpoint-tmp"),
                                                str(link / "5"))
  assert Target.for_step(ORBAX_FORMAT, "ck", 5).final_dir == "ck/5/default"
  assert Target.for_step(StepDirectory(), "ck", 5).final_dir == "ck/5"


def test_begin_answering_another_formats_directory_is_refused():
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"not an uncommitted step directory of format 'steps'"):
    Target.for_step(StepDirectory(), "/ckpt", 7).begun("/ckpt/7.orbax-checkpoint-tmp")


def test_an_item_another_commits_goes_where_its_format_renames_its_step():
  item = "/ckpt/7.orbax-checkpoint-tmp-1700000000/state"
  target = Target.in_step(ORBAX_FORMAT, "/ckpt", item, 7)
  assert (target.directory, target.tmp_dir, target.final_dir, target.whole_step,
          target.tmp_step) == ("/ckpt", item, "/ckpt/7/state", False, "")
  # An item already in its step's own directory stays where it is.
  assert Target.in_step(ORBAX_FORMAT, "/ckpt", "/ckpt/7/state", 7).final_dir == "/ckpt/7/state"


class LayoutSidecars(FakeSidecars):
  """Sidecars that save in ``fmt``: begin answers its tmp directory, a commit puts the step
  where its ``final_of`` says; records where each stage wrote."""

  def __init__(self, fmt, **kw):
    super().__init__(**kw)
    self.fmt, self.staged_at = fmt, []

  def begin(self, host, begin):
    assert begin.format == self.fmt.name, begin.format
    return self._call("begin", host, self.fmt.tmp_of(begin.directory, begin.step))

  def stage(self, host, stage):
    self.staged_at.append((stage.tmp_dir, stage.final_dir))
    return super().stage(host, stage)

  def commit(self, host, commit):
    return self._step_committed(host, commit.tmp_dir, commit.step, commit.leaves, commit.shards,
                                commit.data_state_json)

  def await_commit(self, host, wait):  # as FakeSidecars': the sidecars' agreement
    found = self.fmt.final_of(pathlib.Path(wait.tmp_dir))
    leaves, shards, data_state_json, _ = self.agreed(host, wait.tmp_dir,
                                                     final_dir=str(found.final))
    return self._step_committed(host, wait.tmp_dir, wait.step, leaves, shards, data_state_json)

  def _step_committed(self, host, tmp_dir, step, leaves, shards, data_state_json):
    found = self.fmt.final_of(pathlib.Path(tmp_dir))
    self.manifests[str(found.final)] = Manifest(
        self.fmt.name, tuple(SavedLeaf.of(s) for s in leaves), tuple(shards),
        json.loads(data_state_json) if data_state_json else None, {}, step=step)
    self.steps.setdefault(str(found.committed.parent), set()).add(step)
    return self._call("commit", host, str(found.final))


@pytest.mark.parametrize("fmt", [StepDirectory(), HiddenStaging()], ids=lambda f: f.name)
def test_a_new_formats_layout_needs_nothing_on_the_trainer_side(fmt, monkeypatch):
  """A format registered with a layout of its own (neither Orbax's item nor DCP_FORMAT's one
  directory) is saved, listed and restored by the one Checkpointer with no trainer-side
  change: every directory is the format's."""
  monkeypatch.setattr(formats_lib, "DEFAULT", formats_lib.DEFAULT.replacing(fmt))
  fake = LayoutSidecars(fmt, hosts=(0,))
  w = np.arange(6, dtype=np.float32)
  with checkpointer(fake, format=fmt.name) as ckpt:
    assert ckpt.save(7, {"w": w}, data_state={"at": 7}).durable.result(30) == 7
    assert ckpt.all_steps() == [7]
    restored = ckpt.restore(7, {"w": np.zeros(6, np.float32)})
    assert ckpt.data_state(7) == {"at": 7}
  np.testing.assert_array_equal(restored["w"], w)
  tmp_dir, final_dir = fmt.staged_dirs(fmt.tmp_of("/ckpt/run", 7))
  assert set(fake.staged_at) == {(tmp_dir, final_dir)}
  assert list(fake.manifests) == [final_dir]
