"""The host's save calls (begin, stage, prepared, commit, abort, delete) through the step writer's
seam, its format registry: the real Orbax format, its write wrapped to record what it is
given and when, or to fail. Real files under tmp_path; no server, no processes."""

import errno
import json
import logging
import os
import pathlib
import re
import shutil
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt import dir_fd, records, registry as formats_lib, spec as spec_lib
from sidecar._src.ckptfmt.dcp import commit as dcp_commit
from sidecar._src.ckptfmt.orbax.format import OrbaxFormat
from sidecar._src.ckptfmt.save_values import Abort, Begin, Commit, Prepared, Stage
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import (
  faults,
  ram_tier,
  roots as roots_lib,
  save as checkpoint_save,
  step as step_lib,
  write as write_lib,
)
from sidecar._src.server.checkpoint.caller import Caller
from tests.conftest import eventually
from tests.support import races
from tests.support.ram_steps import AsStaged
from tests.support.staged import staged

pytestmark = pytest.mark.unit

# The registered formats as messages list them (a new format changes no test here).
NAMES = re.escape(repr(formats_lib.DEFAULT.names))

SPECS = [spec_lib.LeafSpec(key_path=("w",), shape=(4, 2), dtype=np.float32, write_shape=(2, 2)),
         spec_lib.LeafSpec(key_path=("b",), shape=(3,), dtype=np.int32)]


def shard(leaf, index, value):
  spec = SPECS[leaf]
  shape = tuple(b - a for a, b in index)
  return staged(spec.key_path, leaf, index, np.full(shape, value, spec.dtype))


class Recording(OrbaxFormat):
  """The real Orbax format, its write recording each shard as it reaches it (``first`` set
  at the first); ``fail`` raised in a shard's place."""

  def __init__(self, fail=None):
    self.seen, self.fail = [], fail
    self.first = threading.Event()

  def write(self, tmp_dir, host_id, numbering, incoming, *, progress, turn):
    def recorded():
      for s in incoming:  # the staged shards themselves
        self.seen.append((s.record.leaf, s.record.index))
        self.first.set()
        if self.fail is not None:
          raise self.fail
        yield s
    return super().write(tmp_dir, host_id, numbering, recorded(), progress=progress, turn=turn)


@pytest.fixture
def make_writer(tmp_path):
  threads = []

  def spawn(target, *args, name):
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    threads.append(t)
    t.start()

  def make(fmt, host=0):
    tier = ram_tier.RamTier(host, uncommitted_s=3600.0)
    return checkpoint_save.StepWriter(host, tier=tier,
                                      roots=roots_lib.Roots(host, (str(tmp_path),)),
                           spawn=spawn, metrics=metrics_lib.Recorder(),
                           formats=formats_lib.DEFAULT.replacing(fmt)), tier

  yield make
  for t in threads:
    t.join(30)
    assert not t.is_alive(), f"{t.name} still writing"


def begun(writer, tmp_path, step, owner="a"):
  directory = str(tmp_path / "ck")
  writer.open(directory)
  tmp_step = writer.begin(Begin(directory, step, "orbax"), Caller(owner=owner))
  final = str(tmp_path / "ck" / str(step) / spec_lib.ITEM)
  return directory, os.path.join(tmp_step, spec_lib.ITEM), final


def test_parts_are_written_as_they_come_and_two_writers_make_one_step(make_writer, tmp_path):
  engine = Recording()
  writer, tier = make_writer(engine)
  directory, tmp_dir, final = begun(writer, tmp_path, 3)
  stage = lambda shards, last, owner: writer.stage(Stage(directory, 3, tmp_dir, final, SPECS,
                                                         shards, last=last, writers=2),
                                                   Caller(owner=owner))
  stage([shard(0, ((0, 2), (0, 2)), 1.0)], False, "a")
  assert engine.first.wait(30)  # written before the rest is staged
  assert engine.seen == [(0, ((0, 2), (0, 2)))]
  stage([shard(0, ((2, 4), (0, 2)), 2.0)], True, "a")
  assert tier.find(final).state is step_lib.State.STAGING  # the other process's last part is due
  assert stage([shard(1, ((0, 3),), 7)], True, "b") == 16 + 16 + 12
  sums = writer.prepared(Prepared(final), Caller(wait_s=30))
  assert sorted((c.key_path, c.index, c.host) for c in sums) == [
      (("b",), ((0, 3),), 0), (("w",), ((0, 2), (0, 2)), 0), (("w",), ((2, 4), (0, 2)), 0)]
  committed = writer.commit(Commit(tmp_dir=tmp_dir, step=3, num_hosts=1, leaves=SPECS, shards=sums,
                                   data_state_json='{"batch": 5}'), Caller(owner="a"))
  assert committed == str(tmp_path / "ck" / "3")
  with open(os.path.join(final, records.MANIFEST_FILE)) as f:
    manifest = json.load(f)
  assert manifest["data_state"] == {"batch": 5} and len(manifest["shards"]) == 3
  assert manifest["format"] == "orbax" and manifest["step"] == 3


def test_a_write_failure_is_a_checkpoint_write_error_and_the_step_is_never_committed(
    make_writer, tmp_path):
  path = str(tmp_path / "ck" / "w" / "0")
  writer, _ = make_writer(Recording(fail=OSError(errno.ENOSPC, "No space left on device",
                                                 path)))
  directory, tmp_dir, final = begun(writer, tmp_path, 4)
  writer.stage(Stage(directory, 4, tmp_dir, final, SPECS, [shard(1, ((0, 3),), 1)], last=True),
               Caller(owner="a"))
  with pytest.raises(errors.CheckpointWriteError, match=r"host 0 could not write step 4: "
                     r"No space left on device \(ENOSPC\)") as e:
    writer.prepared(Prepared(final), Caller(wait_s=30))
  assert (e.value.errno, e.value.path, e.value.host_id) == (errno.ENOSPC, path, 0)
  with pytest.raises(errors.CheckpointWriteError, match=r"^host 0 could not write step 4: "
                     r"No space left on device \(ENOSPC\)"):  # the write's own error
    writer.commit(Commit(tmp_dir=tmp_dir, step=4, num_hosts=1, leaves=SPECS, shards=[],
                         data_state_json="", whole_step=True), Caller(owner="a"))
  writer.abort(Abort(os.path.dirname(tmp_dir), final), Caller())
  assert os.listdir(directory) == []  # no step, no tmp directory


# What the sidecar knows of a trainer's liveness: its worker session attached (a trainer
# that maps the arena), or nothing (one with no worker session: it stages inline).
LIVENESS = {"worker": dict(worker="w", alive=lambda: True), "inline": {}}


@pytest.mark.parametrize("trainer", LIVENESS, ids=list(LIVENESS))
def test_a_part_staged_after_its_saves_write_failed_is_told_the_failure(make_writer, tmp_path,
                                                                       trainer):
  """Issue 69 review: the write fails while its trainer is still staging. Its next part got
  the failure only if it came in the microsecond between the Stage's look at the step and
  its take; a moment later the failed step had left the tier and the part began a new,
  partial step (its commit then 'incomplete'). Now every later part is told the failure,
  and the trainer's abort removes the step. A trainer with no worker session (inline
  Stages: its liveness unknown) too: its failed step left the tier at once before."""
  path = str(tmp_path / "ck" / "w" / "0")
  engine = Recording(fail=OSError(errno.ENOSPC, "No space left on device", path))
  writer, tier = make_writer(engine)
  directory, tmp_dir, final = begun(writer, tmp_path, 4)
  part = lambda shards, last: writer.stage(Stage(directory, 4, tmp_dir, final, SPECS, shards,
                                                 last=last), Caller(owner="a", **LIVENESS[trainer]))
  part([shard(0, ((0, 2), (0, 2)), 1.0)], False)
  own = tier.find(final)
  assert own.wait_written(30) and own.state is step_lib.State.FAILED
  assert eventually(lambda: own.shards == {})  # its bytes let go; its error kept
  for _ in range(2):
    with pytest.raises(errors.CheckpointWriteError, match=r"^host 0 could not write step 4: "
                       r"No space left on device \(ENOSPC\)"):
      part([shard(0, ((2, 4), (0, 2)), 2.0), shard(1, ((0, 3),), 7)], True)
  assert tier.find(final) is own  # nothing new begun in its place
  with pytest.raises(errors.CheckpointWriteError, match=r"^host 0 could not write step 4: "
                     r"No space left on device \(ENOSPC\) writing .*; make room there"):
    writer.commit(Commit(tmp_dir=tmp_dir, step=4, num_hosts=1, leaves=SPECS, shards=[],
                         data_state_json="", whole_step=True), Caller(owner="a"))
  writer.abort(Abort(os.path.dirname(tmp_dir), final), Caller())
  assert tier.find(final) is None and own.state is step_lib.State.DROPPED


@pytest.mark.parametrize("trainer", LIVENESS, ids=list(LIVENESS))
def test_another_writers_part_after_the_write_failed_is_told_the_failure(
    make_writer, tmp_path, monkeypatch, trainer):
  """Two trainer processes stage into this host; the write fails after the first one's
  first part. The second one's first part began a new, partial step in the failed one's
  place (and the first one's later parts joined it): now it is told the failure. A part
  that comes once the save's parts would have stopped coming (``STAGE_TIMEOUT_S`` after
  the failure) is another save's: it begins its step anew."""
  engine = Recording(fail=OSError(errno.EIO, "Input/output error", "w/0"))
  writer, tier = make_writer(engine)
  directory, tmp_dir, final = begun(writer, tmp_path, 4)
  part = lambda owner, shards: writer.stage(Stage(directory, 4, tmp_dir, final, SPECS, shards,
                                                  last=True, writers=2), Caller(owner=owner,
                                                                                **LIVENESS[trainer]))
  part("a", [shard(0, ((0, 2), (0, 2)), 1.0)])
  own = tier.find(final)
  assert own.wait_written(30) and own.state is step_lib.State.FAILED
  with pytest.raises(errors.CheckpointWriteError, match=r"^host 0 could not write step 4: "
                     r"Input/output error \(EIO\) writing w/0"):
    part("b", [shard(0, ((2, 4), (0, 2)), 2.0), shard(1, ((0, 3),), 7)])
  assert tier.find(final) is own
  # Long after the failure: its write ended STAGE_TIMEOUT_S + 1 s ago. The new save is
  # whole in one part (one writer), so its writer waits for no other.
  monkeypatch.setattr(own, "_finished", own.finished - write_lib.STAGE_TIMEOUT_S - 1)
  engine.fail = None
  whole = [shard(0, ((0, 2), (0, 2)), 1.0), shard(0, ((2, 4), (0, 2)), 2.0),
           shard(1, ((0, 3),), 7)]
  writer.stage(Stage(directory, 4, tmp_dir, final, SPECS, whole, last=True, writers=1),
               Caller(owner="b", **LIVENESS[trainer]))
  assert tier.find(final) is not own and own.state is step_lib.State.DROPPED


def test_a_failed_step_kept_for_its_trainer_expires_as_an_uncommitted_one(make_writer, tmp_path,
                                                                         caplog):
  """The failed step of a trainer whose liveness is unknown (inline Stages), kept for it
  to learn why, is not kept for good where it never comes back: it goes as an uncommitted
  step does (``RamTier.uncommitted_s`` after the failure, 600 s by default). Its warning
  says its write failed, and why, not that it was "staged and written" with bytes freed
  now: they went at the failure."""
  writer, tier = make_writer(Recording(fail=OSError(errno.ENOSPC, "No space left on device")))
  directory, tmp_dir, final = begun(writer, tmp_path, 4)
  writer.stage(Stage(directory, 4, tmp_dir, final, SPECS, [shard(1, ((0, 3),), 1)],
                     last=False), Caller(owner="a"))
  own = tier.find(final)
  assert own.wait_written(30) and own.state is step_lib.State.FAILED
  assert eventually(lambda: own.shards == {})  # its bytes let go at the failure
  assert tier.expire_uncommitted() == [] and tier.find(final) is own  # within its time
  tier.uncommitted_s = 0.0
  caplog.set_level(logging.WARNING, logger="sidecar._src.server.checkpoint.ram_tier")
  assert tier.expire_uncommitted() == [4] and tier.find(final) is None
  assert re.search(r"step 4 of \S+/ck: its write failed \d+ s ago \(OSError: \[Errno 28\] No "
                   r"space left on device\) and it was never aborted \(the controller that "
                   r"staged it is gone\?\): its record goes now \(its bytes went back at that "
                   r"failure\)", caplog.text), caplog.text
  assert "staged and written" not in caplog.text


def test_abort_stops_a_writer_waiting_for_parts_and_lets_the_blocks_go(make_writer, tmp_path):
  engine = Recording()
  writer, tier = make_writer(engine)
  directory, tmp_dir, final = begun(writer, tmp_path, 5)
  part = [shard(0, ((0, 2), (0, 2)), 1.0)]
  writer.stage(Stage(directory, 5, tmp_dir, final, SPECS, part, last=False), Caller(owner="a"))
  assert engine.first.wait(30)
  own = tier.find(final)
  writer.abort(Abort(os.path.dirname(tmp_dir), final), Caller())
  assert own.wait_written(0) and isinstance(own.error, errors.ClosedError)
  assert own.state is step_lib.State.DROPPED  # aborted mid-write: its write's end recorded
  assert tier.find(final) is None and own.shards == {}
  assert os.listdir(directory) == []


def test_another_session_neither_stages_into_nor_commits_a_save(make_writer, tmp_path):
  writer, _ = make_writer(Recording())
  directory, tmp_dir, final = begun(writer, tmp_path, 6)
  writer.stage(Stage(directory, 6, tmp_dir, final, SPECS, [shard(1, ((0, 3),), 1)], last=False),
               Caller(owner="a"))
  with pytest.raises(errors.PermissionDeniedError, match="being saved by another session"):
    writer.stage(Stage(directory, 6, tmp_dir, final, SPECS, [], last=True), Caller(owner="b"))
  with pytest.raises(errors.PermissionDeniedError, match="being saved by another session"):
    writer.begin(Begin(directory, 6, "orbax"), Caller(owner="b"))
  writer.stage(Stage(directory, 6, tmp_dir, final, SPECS, [shard(0, ((0, 4), (0, 2)), 2.0)],
                     last=True), Caller(owner="a"))
  sums = writer.prepared(Prepared(final), Caller(wait_s=30))
  with pytest.raises(errors.PermissionDeniedError, match="a session commits only the save"):
    writer.commit(Commit(tmp_dir=tmp_dir, step=6, num_hosts=1, leaves=SPECS, shards=sums,
                         data_state_json="", whole_step=True), Caller(owner="b"))
  writer.commit(Commit(tmp_dir=tmp_dir, step=6, num_hosts=1, leaves=SPECS, shards=sums,
                       data_state_json="", whole_step=True), Caller(owner="a"))
  assert sorted(os.listdir(directory)) == ["6"]


def test_a_shard_of_a_leaf_the_step_lacks_is_refused_and_nothing_is_staged(make_writer, tmp_path):
  writer, tier = make_writer(Recording())
  directory, tmp_dir, final = begun(writer, tmp_path, 7)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"^step 7 on host 0: shard of leaf 2: the step has 2 leaves$"):
    writer.stage(Stage(directory, 7, tmp_dir, final, SPECS,
                       [shard(1, ((0, 3),), 1), staged(("c",), 2, ((0, 1),), np.zeros(1))],
                       last=False), Caller(owner="a"))
  assert tier.find(final).shards == {} and tier.find(final).nbytes == 0
  writer.abort(Abort(os.path.dirname(tmp_dir), final), Caller())


@pytest.mark.parametrize("bad, match", [
    (staged(("w",), 1, ((0, 3),), np.zeros(3, np.int32)),
     r"shard of leaf 1 names \['w'\], the leaf is \['b'\]"),
    (staged(("b",), 1, ((0, 3),), np.zeros(3, np.int32), rank=2),
     r"shard of leaf 1 names \['b'\] of rank 2"),
    (staged(("b",), 1, ((0, 3),), np.zeros(3, np.int32), host=3),
     r"shard \['b'\] at \[\[0, 3\]\] names host 3, staged on host 0"),
], ids=["another-leaf", "a-rank", "another-host"])
def test_a_record_that_names_another_shard_is_refused(make_writer, tmp_path, bad, match):
  """A record's number, its id, its rank and its host must agree with the step's leaves
  and this sidecar: nothing of the part is staged otherwise."""
  writer, tier = make_writer(Recording())
  directory, tmp_dir, final = begun(writer, tmp_path, 7)
  with pytest.raises(errors.InvalidArgumentError, match=match):
    writer.stage(Stage(directory, 7, tmp_dir, final, SPECS, [shard(0, ((0, 2), (0, 2)), 1), bad],
                       last=False), Caller(owner="a"))
  assert tier.find(final).shards == {} and tier.find(final).nbytes == 0
  writer.abort(Abort(os.path.dirname(tmp_dir), final), Caller())


def test_a_format_part_the_steps_format_does_not_take_is_refused(make_writer, tmp_path):
  from sidecar._src.ckptfmt.dcp import DcpPart
  writer, _ = make_writer(Recording())
  directory, tmp_dir, final = begun(writer, tmp_path, 8)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"stage: a Stage of a step in orbax's layout carries no format extra, "
                     r"got DcpPart"):
    writer.stage(Stage(directory, 8, tmp_dir, final, SPECS, [], extra=DcpPart(0, 0)),
                 Caller(owner="a"))
  with pytest.raises(errors.InvalidArgumentError, match=r"format must be one of the registered "
                     rf"formats {NAMES}, got 'safetensors'"):
    writer.begin(Begin(directory, 9, "safetensors"), Caller(owner="a"))


def test_another_sessions_begin_is_refused_from_the_firsts_begin_while_its_trainer_is_there(
    make_writer, tmp_path):
  # Issue 55 item 6: between a Begin and its first Stage nothing of the save was recorded,
  # and another session's Begin (or an open's sweep) made the step's directory anew.
  writer, _ = make_writer(Recording())
  there = [True]
  directory = str(tmp_path / "ck")
  writer.open(directory)
  tmp = writer.begin(Begin(directory, 2, "orbax"), Caller(owner="a", alive=lambda: there[0]))
  with pytest.raises(errors.PermissionDeniedError,
                     match=r"begin: step 2 of '.*ck' is being saved by another session \(another "
                           r"trainer process or Controller\) on host 0: another save of step 2 "
                           r"into this directory is in flight"):
    writer.begin(Begin(directory, 2, "orbax"), Caller(owner="b", alive=lambda: True))
  assert writer.open(directory) == [] and os.path.isdir(tmp)  # no sweep of it either
  assert writer.begin(Begin(directory, 2, "orbax"),
                      Caller(owner="a", alive=lambda: there[0])) == tmp  # a retry
  there[0] = False  # its worker's connection closed: its process died
  assert writer.begin(Begin(directory, 2, "orbax"), Caller(owner="b", alive=lambda: True)) == tmp
  writer.abort(Abort(tmp, str(tmp_path / "ck" / "2" / spec_lib.ITEM)), Caller())  # ends b's save
  assert writer.begin(Begin(directory, 2, "orbax"), Caller(owner="c")) == tmp


def test_a_begun_save_is_in_flight_until_committed_and_one_that_never_stages_goes(
    make_writer, tmp_path, monkeypatch):
  writer, _ = make_writer(Recording())
  directory, tmp_dir, final = begun(writer, tmp_path, 3)  # its trainer's liveness not known
  writer.stage(Stage(directory, 3, tmp_dir, final, SPECS, [shard(0, ((0, 4), (0, 2)), 1.0),
                     shard(1, ((0, 3),), 1)]), Caller(owner="a"))
  sums = writer.prepared(Prepared(final), Caller(wait_s=30))
  writer.commit(Commit(tmp_dir=tmp_dir, step=3, num_hosts=1, leaves=SPECS, shards=sums,
                       data_state_json="", whole_step=True), Caller(owner="a"))
  # Not refused as in flight (it ended): a race lost, the documented error, no FileExistsError.
  with pytest.raises(errors.PermissionDeniedError,
                     match=r"begin: step 3 of '.*ck' is being saved by another checkpointer, or "
                           r"was: step 3 is already committed at .*ck/3; a save never replaces "
                           r"a committed step"):
    writer.begin(Begin(directory, 3, "orbax"), Caller(owner="b"))
  monkeypatch.setattr(write_lib, "STAGE_TIMEOUT_S", 0.0)  # no Stage came in time
  writer.begin(Begin(directory, 4, "orbax"), Caller(owner="a", alive=lambda: True))
  writer.begin(Begin(directory, 4, "orbax"), Caller(owner="b", alive=lambda: True))


def test_a_begin_that_loses_the_race_to_another_sidecars_begin_says_so(make_writer, tmp_path,
                                                                        monkeypatch):
  # Issue 63 item 5: two checkpointers (two jobs, each its own sidecar) began one step of
  # one directory at once; the loser read "CheckpointWriteError: Begin: FileExistsError".
  ours, _ = make_writer(Recording())
  theirs, _ = make_writer(Recording())  # another sidecar's writer: it knows nothing of ours
  directory = str(tmp_path / "ck")
  ours.open(directory)
  tmp = pathlib.Path(ours.tmp_of(directory, 5))
  real, pending = shutil.rmtree, [tmp]

  def rmtree(path, *args, **kwargs):  # theirs makes the directory just after ours cleared it
    real(path, *args, **kwargs)
    if pending and pathlib.Path(path).name == pending[0].name:  # (relative to its directory)
      pending.clear()
      theirs.begin(Begin(directory, 5, "orbax"), Caller(owner="b"))
  monkeypatch.setattr(shutil, "rmtree", rmtree)
  with pytest.raises(errors.PermissionDeniedError,
                     match=r"begin: step 5 of '.*ck' is being saved by another checkpointer, or "
                           rf"was: File exists \({re.escape(str(tmp))}\); a save never replaces "
                           r"a committed step: save each step of a directory from one "
                           r"checkpointer \(one job per directory\)"):
    ours.begin(Begin(directory, 5, "orbax"), Caller(owner="a"))
  assert not pending and tmp.is_dir()  # the race happened; their save's directory stands
  assert ours.begin(Begin(directory, 6, "orbax"), Caller(owner="a"))  # and ours serves on


class HeldFinish(Recording):
  """The real Orbax format, the finishing of a step's directory (``begin_tmp``'s second
  half: its ``_CHECKPOINT_METADATA``) held until ``release`` is set, then failing with
  ``fail`` if one is given; ``finishing`` is set as it starts."""

  def __init__(self, fail=None):
    super().__init__()
    self.release, self.finishing = threading.Event(), threading.Event()
    self.finished_on = []  # the threads that finished a directory
    self.fail_finishing = fail

  def begin_tmp(self, directory, step, **kw):
    tmp, finish = super().begin_tmp(directory, step, **kw)

    def later():
      self.finishing.set()
      assert self.release.wait(30)
      self.finished_on.append(threading.current_thread().name)
      if self.fail_finishing is not None:
        raise self.fail_finishing
      finish()
    return tmp, later


def begun_by_stage(writer, tmp_path, step):
  """Opens ``ck`` and begins ``step`` as a Stage that begins it does (session "a"): the
  directory, the tmp_dir it stages into, its final_dir and what finishes the directory."""
  directory = str(tmp_path / "ck")
  writer.open(directory)
  tmp_dir, final = OrbaxFormat().staged_dirs(OrbaxFormat().tmp_of(directory, step))
  tmp_step, finish = writer.begin_staged(
      Stage(directory, step, tmp_dir, final, begin=Begin(directory, step, "orbax")),
      Caller(owner="a"))
  assert tmp_step == os.path.dirname(tmp_dir)
  return directory, tmp_dir, final, finish


def test_a_stage_that_begins_its_step_answers_before_its_metadata_is_written(make_writer,
                                                                            tmp_path):
  # Issue 69 item 5: a kept save at one round trip. The step's directory is made (anew: a
  # dead save's leftover goes) before the Stage answers; its _CHECKPOINT_METADATA is
  # written by the step's writer thread, before it writes: not on the Stage's answer,
  # which the trainer's save() waits for.
  engine = HeldFinish()
  writer, _ = make_writer(engine)
  directory = str(tmp_path / "ck")
  leftover = tmp_path / "ck" / "3.orbax-checkpoint-tmp"
  (leftover / spec_lib.ITEM).mkdir(parents=True)  # a dead save's, never committed
  (leftover / spec_lib.ITEM / "stale").write_text("from a save that died")
  (leftover / "_CHECKPOINT_METADATA").write_text('{"init_timestamp_nsecs": 1}')
  directory, tmp_dir, final, finish = begun_by_stage(writer, tmp_path, 3)
  assert os.listdir(leftover) == []  # made anew before it answers
  whole = [shard(0, ((0, 2), (0, 2)), 1.0), shard(0, ((2, 4), (0, 2)), 2.0),
           shard(1, ((0, 3),), 7)]
  assert writer.stage(Stage(directory, 3, tmp_dir, final, SPECS, whole, last=True),
                      Caller(owner="a"), finish_tmp=finish) == 16 + 16 + 12
  assert engine.finishing.wait(30)  # its writer finishes it: held, and the Stage answered
  assert os.listdir(leftover) == [] and engine.seen == []
  with pytest.raises(errors.PermissionDeniedError, match="being saved by another session"):
    writer.begin(Begin(directory, 3, "orbax"),
                 Caller(owner="b", alive=lambda: True))  # begun: in flight
  engine.release.set()
  sums = writer.prepared(Prepared(final), Caller(wait_s=30))
  assert engine.finished_on == ["sidecar-ckpt-3"]
  assert writer.commit(Commit(tmp_dir=tmp_dir, step=3, num_hosts=1, leaves=SPECS, shards=sums,
                              data_state_json="", whole_step=True), Caller(owner="a")) == str(
      tmp_path / "ck" / "3")
  assert os.listdir(directory) == ["3"]
  assert not (tmp_path / "ck" / "3" / spec_lib.ITEM / "stale").exists()
  meta = json.loads((tmp_path / "ck" / "3" / "_CHECKPOINT_METADATA").read_text())
  assert 1 < meta["init_timestamp_nsecs"] <= meta["commit_timestamp_nsecs"]


def test_a_step_begun_by_a_stage_keeps_the_parts_other_hosts_wrote_before_it_finished(
    make_writer, tmp_path):
  # The race that reverted the first try (96e12a9d): host 0's writer made the step's
  # directory (rmtree, mkdir) after host 1, told it was begun, had written its part
  # there: the step was lost. The directory is made before the Stage answers; what its
  # writer finishes later removes nothing.
  engine = HeldFinish()
  ours, _ = make_writer(engine)
  theirs, _ = make_writer(Recording(), host=1)
  directory, tmp_dir, final, finish = begun_by_stage(ours, tmp_path, 4)
  ours.stage(Stage(directory, 4, tmp_dir, final, SPECS, [shard(0, ((0, 2), (0, 2)), 1.0)],
                   last=True), Caller(owner="a"), finish_tmp=finish)
  assert engine.finishing.wait(30)  # held: host 0's writer has not finished it yet
  theirs.stage(Stage(directory, 4, tmp_dir, final, SPECS,  # host 1, told the step is begun
                     [shard(0, ((2, 4), (0, 2)), 2.0),
                      shard(1, ((0, 3),), 7)], last=True), Caller(owner="a"))
  written = theirs.prepared(Prepared(final), Caller(wait_s=30))  # host 1's part is on storage
  engine.release.set()
  sums = ours.prepared(Prepared(final), Caller(wait_s=30)) + written
  assert ours.commit(Commit(tmp_dir=tmp_dir, step=4, num_hosts=2, leaves=SPECS, shards=sums,
                            data_state_json="", whole_step=True), Caller(owner="a")) == str(
      tmp_path / "ck" / "4")
  committed = tmp_path / "ck" / "4" / spec_lib.ITEM
  assert sorted(os.listdir(committed / "array_metadatas")) == ["process_0", "process_1"]
  assert sorted(os.listdir(committed / "w")) == [".zarray", "0.0", "1.0"]


def test_a_step_whose_directory_could_not_be_finished_fails_as_a_failed_write(make_writer,
                                                                             tmp_path):
  # What the writer thread's finishing raises (a full disk) fails the step's write: the
  # trainer's next save or wait raises it; nothing is committed, the abort cleans.
  engine = HeldFinish(fail=OSError(errno.ENOSPC, "No space left on device", "meta"))
  writer, tier = make_writer(engine)
  directory, tmp_dir, final, finish = begun_by_stage(writer, tmp_path, 4)
  writer.stage(Stage(directory, 4, tmp_dir, final, SPECS, [shard(1, ((0, 3),), 7)], last=True),
               Caller(owner="a"), finish_tmp=finish)
  engine.release.set()
  with pytest.raises(errors.CheckpointWriteError,
                     match=r"host 0 could not write step 4: No space left on device \(ENOSPC\) "
                           r"writing meta"):
    writer.prepared(Prepared(final), Caller(wait_s=30))
  assert engine.seen == []  # nothing written
  with pytest.raises(errors.CheckpointWriteError, match=r"No space left on device \(ENOSPC\) "
                     r"writing meta"):  # the write's own error
    writer.commit(Commit(tmp_dir=tmp_dir, step=4, num_hosts=1, leaves=SPECS, shards=[],
                         data_state_json="", whole_step=True), Caller(owner="a"))
  writer.abort(Abort(os.path.dirname(tmp_dir), final), Caller())
  assert os.listdir(directory) == [] and tier.find(final) is None
  engine.fail_finishing = None
  assert writer.begin(Begin(directory, 4, "orbax"), Caller(owner="b"))  # not in flight any more


class Pruned(OrbaxFormat):
  """The real Orbax format, with another host's delete of ``step`` run at the racy moment
  ``when``: as the check that it is a checkpoint starts ("check"), or once that check said
  it is one ("rename")."""

  def __init__(self, step, when):
    self.step, self.when = step, when

  def is_checkpoint(self, path):
    this = os.path.realpath(path) == str(self.step)  # (asked through its descriptor)
    if this and self.when == "check":
      shutil.rmtree(self.step)
    found = super().is_checkpoint(path)
    if this and self.when == "rename" and found:
      shutil.rmtree(self.step)
    return found


@pytest.mark.parametrize("when", ["check", "rename"], ids=["before-its-check", "before-the-rename"])
def test_a_step_another_delete_removes_meanwhile_is_gone_not_an_error(make_writer, tmp_path, when):
  # Two retentions delete one step at once (a restarted job's and the old one's): the
  # second found the step a directory, then it was gone before its check or its rename.
  # It answered "not a checkpoint step directory" (or raised ENOENT); gone is what it asked.
  step = tmp_path / "ck" / "3"
  (step / spec_lib.ITEM).mkdir(parents=True)
  (step / spec_lib.ITEM / spec_lib.METADATA_FILE).write_text("{}")
  writer, _ = make_writer(Pruned(step, when))
  writer.delete(str(tmp_path / "ck"), 3)
  assert os.listdir(tmp_path / "ck") == []  # nothing half deleted is left either


def test_an_abort_another_hosts_abort_finishes_first_is_not_refused(
    make_writer, tmp_path, monkeypatch):
  # Every host aborts a failed DCP save of one directory on shared storage at once. This
  # one found the uncommitted directory there, then the other's removal took it before
  # this one looked for the mark of a save in it: refused as "not made by a save".
  writer, _ = make_writer(Recording())
  tmp = dcp_commit.create_tmp(tmp_path / "ck" / "ckpt")
  pending = races.removed_first(monkeypatch, dcp_commit, "is_ours", tmp)  # the other's abort
  writer.abort(Abort(str(tmp), str(tmp_path / "ck" / "ckpt")), Caller())
  assert not pending and os.listdir(tmp_path / "ck") == []


@pytest.mark.parametrize("how", ["abort", "open"], ids=["abort", "open-sweep"])
def test_an_uncommitted_directory_is_never_seen_half_removed(make_writer, tmp_path, monkeypatch,
                                                             how):
  # Another host that looks while this one removes a DCP save's uncommitted directory
  # must find it whole (with its mark of a save) or gone: its name goes before its files.
  writer, _ = make_writer(Recording())
  tmp = dcp_commit.create_tmp(tmp_path / "ck" / "ckpt")
  real, seen = shutil.rmtree, []

  def watched(path, *args, **kwargs):
    seen.append((pathlib.Path(path).name, tmp.exists()))
    return real(path, *args, **kwargs)
  monkeypatch.setattr(dir_fd.shutil, "rmtree", watched)
  if how == "abort":
    writer.abort(Abort(str(tmp), str(tmp_path / "ck" / "ckpt")), Caller())
  else:
    writer.open(str(tmp_path / "ck"))
  assert [there for _, there in seen] == [False]  # its name was gone when its files went
  assert seen[0][0].startswith(f".{tmp.name}{dir_fd.DELETING}")
  assert os.listdir(tmp_path / "ck") == []


def test_tensorstores_full_disk_is_a_checkpoint_write_error_naming_the_file(make_writer,
                                                                             tmp_path):
  """TensorStore writes through the part's directory's descriptor and says a full disk in
  its own words: the error is CheckpointWriteError with ENOSPC and the file's own path (it
  was InvalidArgumentError naming /proc/self/fd/N)."""
  failure = ValueError(
      'RESOURCE_EXHAUSTED: Error writing local file "/proc/self/fd/20/b/0": Failed writing: '
      '"/proc/self/fd/20/b/0.__lock": Failed to write 4 bytes to file 21: No space left on '
      "device [os_error_code='28']")
  writer, _ = make_writer(Recording(fail=failure))
  directory, tmp_dir, final = begun(writer, tmp_path, 4)
  writer.stage(Stage(directory, 4, tmp_dir, final, SPECS, [shard(1, ((0, 3),), 1)]),
               Caller(owner="a"))
  with pytest.raises(errors.CheckpointWriteError, match=r"host 0 could not write step 4: No "
                     r"space left on device \(RESOURCE_EXHAUSTED") as e:
    writer.prepared(Prepared(final), Caller(wait_s=30))
  path = os.path.join(os.path.realpath(tmp_dir), "b", "0")
  assert (e.value.errno, e.value.path, e.value.host_id) == (errno.ENOSPC, path, 0)
  assert "/proc/self/fd" not in str(e.value) and f"(ENOSPC) writing {path}" in str(e.value)
  writer.abort(Abort(os.path.dirname(tmp_dir), final), Caller())


def test_an_abort_of_a_dcp_save_again_at_a_committed_path_is_that_saves(make_writer, tmp_path):
  """DCP's commit replaces a checkpoint at its path: the RAM tier may still hold the step a
  commit here put there when a new save of the path begins. That save's abort aborts it
  (its directory goes), never answers with the older save's commit."""
  writer, tier = make_writer(Recording())
  directory, path = str(tmp_path / "ck"), str(tmp_path / "ck" / "ckpt")
  writer.open(directory)
  older = step_lib.Step(directory, 1, path, tmp_dir=f"{path}.dcp-checkpoint-tmp",
                        format="dcp", numbering=AsStaged())
  older.take("a", None, [], last=True, writers=1)
  older.end_write([])
  older.commit_gate.begin()
  older.commit_gate.end(path)  # committed here at `path`, and still held
  tier.add(older)
  tier.mark_committed(path)
  tmp = writer.begin(Begin(path, 1, "dcp"), Caller(owner="a"))  # the new save of the path
  assert writer.abort(Abort(tmp, path), Caller()) == ""
  assert not os.path.exists(tmp)


def test_an_open_keeps_a_step_waiting_for_its_commit_and_sweeps_one_whose_trainer_is_gone(
    make_writer, tmp_path):
  """A written step whose trainer commits it is in flight till its commit: one whose trainer
  has no worker session here (its liveness not known: ``attach=False``) was swept by an
  open between its prepared and its commit. One whose trainer is known gone still goes."""
  writer, _ = make_writer(Recording())
  there = [True]
  directory, tmp_dir, final = begun(writer, tmp_path, 3)  # its trainer's liveness not known
  writer.stage(Stage(directory, 3, tmp_dir, final, SPECS, [shard(0, ((0, 4), (0, 2)), 1.0),
                     shard(1, ((0, 3),), 1)]), Caller(owner="a"))
  sums = writer.prepared(Prepared(final), Caller(wait_s=30))
  tmp4 = writer.begin(Begin(directory, 4, "orbax"), Caller(owner="b", alive=lambda: there[0]))
  final4 = str(tmp_path / "ck" / "4" / spec_lib.ITEM)
  writer.stage(Stage(directory, 4, os.path.join(tmp4, spec_lib.ITEM), final4, SPECS,
                     [shard(1, ((0, 3),), 4)]), Caller(owner="b", worker="w",
                                                       alive=lambda: there[0]))
  writer.prepared(Prepared(final4), Caller(wait_s=30))
  there[0] = False  # its trainer died before its commit: its step is a dead save's
  assert writer.open(directory) == []
  assert os.path.isdir(tmp_dir) and not os.path.exists(tmp4)
  assert writer.commit(Commit(tmp_dir=tmp_dir, step=3, num_hosts=1, leaves=SPECS, shards=sums,
                              data_state_json="", whole_step=True), Caller(owner="a")) == str(
      tmp_path / "ck" / "3")


def test_another_sessions_begin_during_a_commit_is_refused_and_removes_nothing(
    make_writer, tmp_path, monkeypatch, caplog):
  """Another session's Begin of a step whose commit runs (its files in place, its rename
  to come: ``slowrename@3:PATH``), its trainer's liveness not known, made the step's
  directory anew under the commit, which then renamed that: step 3 was committed with its
  _CHECKPOINT_METADATA alone, every file of its item gone. Now that Begin is refused."""
  release = tmp_path / "release"
  monkeypatch.setenv(faults.FAULT_ENV, f"slowrename@3:{release}")
  caplog.set_level(logging.INFO, logger="sidecar")
  writer, _ = make_writer(Recording())
  directory, tmp_dir, final = begun(writer, tmp_path, 3)
  writer.stage(Stage(directory, 3, tmp_dir, final, SPECS, [shard(0, ((0, 4), (0, 2)), 1.0),
                     shard(1, ((0, 3),), 1)]), Caller(owner="a"))
  sums = writer.prepared(Prepared(final), Caller(wait_s=30))
  committed = []
  commit = threading.Thread(target=lambda: committed.append(writer.commit(
      Commit(tmp_dir=tmp_dir, step=3, num_hosts=1, leaves=SPECS, shards=sums),
      Caller(owner="a"))))
  commit.start()
  try:
    assert eventually(lambda: "holding slowrename of step 3" in caplog.text, 30)
    with pytest.raises(errors.PermissionDeniedError, match=r"begin: step 3 of '.*ck' is being "
                       r"saved by another session"):
      writer.begin(Begin(directory, 3, "orbax"), Caller(owner="b", alive=lambda: True))
  finally:
    release.touch()
    commit.join(60)
  assert committed == [str(tmp_path / "ck" / "3")]
  assert os.listdir(directory) == ["3"]


@pytest.mark.parametrize("fmt, name", [("orbax", "5.orbax-checkpoint-tmp"),
                                       ("dcp", "m.dcp-checkpoint-tmp")], ids=["orbax", "dcp"])
def test_a_symlink_where_a_steps_uncommitted_directory_goes_is_in_the_way_not_followed(
    make_writer, tmp_path, fmt, name):
  writer, _ = make_writer(Recording())
  directory = tmp_path / "ck"
  writer.open(str(directory))
  (tmp_path / "elsewhere").mkdir()
  (tmp_path / "elsewhere" / "keep").write_text("")
  (directory / name).symlink_to(tmp_path / "elsewhere")
  with pytest.raises(errors.PermissionDeniedError):
    writer.begin(Begin(str(directory / "m") if fmt == "dcp" else str(directory), 5, fmt),
                 Caller(owner="a"))
  assert (directory / name).is_symlink() and os.listdir(tmp_path / "elsewhere") == ["keep"]
