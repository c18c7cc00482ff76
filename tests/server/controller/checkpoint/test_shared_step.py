"""Tier 2: a step that several sidecars save into one directory, which they took over
(its committer: host 0), meets a failure in its commit.

Two real in-process sidecars (hosts 0 and 1) on one checkpoint directory, each with its
part of step 1. The trainers' abort never damages the step the committer commits
meanwhile (``SaveProtocol.abort``): the committer is held inside its commit by the fault
point ``slowrename@STEP:PATH`` (every file in place, the step's rename to come) while the
lead trainer aborts the step on every host, as its controller does; host 1's files lie in
the very item the committer is about to rename. A disk's error in the commit is a typed
``CheckpointWriteError`` wherever the sidecars' decision goes (the ``Agree`` to host 1, the
trainer's wait for the commit).
"""

import errno
import logging
import os
import pathlib
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt import dir_fd, registry as formats_lib
from sidecar._src.ckptfmt.records import MANIFEST_FILE, CommitPlan, Manifest
from sidecar._src.ckptfmt.spec import COMMIT_SUCCESS_FILE, LeafKind, LeafSpec
from sidecar._src.controller.checkpoint.client import CheckpointClient
from sidecar._src.controller.checkpoint.save_protocol import SaveProtocol, Target
from sidecar._src.controller.connection import CallWindow
from sidecar._src.core import errors
from sidecar._src.server.checkpoint import faults
from sidecar._src.wire import checkpoint_wire as wire, protocol as protocol_lib
from sidecar._src.wire.protocol import ckpt_pb
from tests.conftest import eventually
from tests.support.raw_client import Raw, rejected
from tests.support.staged import staged

pytestmark = pytest.mark.server

STEP = 1
HOSTS = (0, 1)


class Connection:
  """What ``CheckpointClient`` calls a host through: a ``Raw`` client's channel."""

  def __init__(self, raw: Raw, host: int):
    self.raw, self.address = raw, f"host {host}"
    self.checkpoint, self.metadata = raw.ckpt, raw.metadata
    self.checkpoint_calls = CallWindow(8, name=self.address)


@pytest.fixture
def two_hosts(make_server, tmp_path):
  raws = [Raw(make_server(token="t", host_id=h).port, token="t") for h in HOSTS]
  conns = [Connection(raw, h) for h, raw in enumerate(raws)]
  client = CheckpointClient(select=list, connection=conns.__getitem__, worker=lambda h: None,
                            status=lambda **kw: [], timeout=30)
  yield raws, client
  client.close()
  for c in conns:
    c.checkpoint_calls.close()
  for raw in raws:
    raw.close()


def stage(raw: Raw, host: int, directory: str, item: pathlib.Path, final_dir: str) -> None:
  """Host ``host``'s part of step 1 (half of the leaf "w"), its last, with the plan: the
  sidecars take the step over; host 0's begins it."""
  leaf = LeafSpec(key_path=("w",), shape=(16,), dtype=np.dtype(np.float32),
                  kind=LeafKind.NUMPY, write_shape=(8,))
  request = ckpt_pb.CheckpointStageRequest(
      directory=directory, step=STEP, tmp_dir=str(item), final_dir=final_dir,
      leaves=[wire.leaf_to_pb(leaf)], last=True, begin_format="orbax" if host == 0 else "")
  wire.plan_to_pb(request.plan, CommitPlan(save="save-1", committer=0, hosts=HOSTS,
                                           lead=host == 0))
  half = (host * 8, host * 8 + 8)
  wire.staged_to_pb(request, [staged(("w",), 0, (half,), np.arange(*half, dtype=np.float32),
                                     host=host)], None)
  raw.ckpt.Stage(request, metadata=raw.metadata, timeout=30)


def test_an_abort_on_every_host_during_the_committers_rename_leaves_the_step_whole(
    two_hosts, tmp_path, monkeypatch, caplog):
  """The committer is asked first and alone: it waits for its commit and says the step is
  committed, and no other host removes its files (they are the committed step's)."""
  raws, client = two_hosts
  directory = str(tmp_path / "ck")
  for raw in raws:
    raw.ckpt.Open(ckpt_pb.CheckpointOpenRequest(directory=directory, ram_steps=1),
                  metadata=raw.metadata, timeout=30)
  fmt = formats_lib.DEFAULT.get("orbax")
  tmp_step = pathlib.Path(f"{directory}/{STEP}.orbax-checkpoint-tmp")
  target = Target.for_step(fmt, directory, STEP).begun(str(tmp_step))
  item = pathlib.Path(target.tmp_dir)
  release = tmp_path / "release"
  monkeypatch.setenv(faults.FAULT_ENV, f"slowrename@{STEP}:{release}")
  caplog.set_level(logging.INFO, logger="sidecar")
  for host, raw in enumerate(raws):
    stage(raw, host, directory, item, target.final_dir)
  # Held inside the commit: every host's file in place, the step's rename to come.
  assert eventually(lambda: (tmp_step / COMMIT_SUCCESS_FILE).is_file(), 30)
  protocol = SaveProtocol(client=client, directory=directory, format="orbax")
  answer: list = []
  aborting = threading.Thread(
      target=lambda: answer.append(protocol.abort(target, list(HOSTS), committer=0)))
  aborting.start()
  assert eventually(lambda: "waits for its commit under way" in caplog.text, 30)
  eventually(lambda: not item.is_dir(), 1)  # (a removal by another host would be done by now)
  release.touch()
  aborting.join(60)
  final = pathlib.Path(directory) / str(STEP)
  assert answer == [str(final)]
  # The step the sidecars committed is whole: listed, its item with every file it lists.
  manifest = Manifest.from_json((final / "default" / MANIFEST_FILE).read_bytes(), "manifest")
  fmt.check_stored(str(final / "default"), manifest)
  for raw in raws:
    assert list(raw.ckpt.Open(ckpt_pb.CheckpointOpenRequest(
        directory=directory, ram_steps=1), metadata=raw.metadata, timeout=30).steps) == [STEP]
  assert f"step {STEP} was committed by host 0's sidecar before the abort reached it" \
      in caplog.text
  assert not list(pathlib.Path(directory).rglob("*sidecar-deleting*"))


def test_a_disk_error_in_the_sidecars_commit_is_a_checkpoint_write_error_everywhere(
    two_hosts, tmp_path, monkeypatch, caplog):
  """The step's rename fails with EIO on the committer (a failing disk): the step is
  abandoned, and its error is CheckpointWriteError with its errno, path and host, with
  the fix, in the committer's decision, in host 1's (told over Agree) and at the trainer."""
  raws, _ = two_hosts
  directory = str(tmp_path / "ck")
  tmp_step = pathlib.Path(f"{directory}/{STEP}.orbax-checkpoint-tmp")
  target = Target.for_step(formats_lib.DEFAULT.get("orbax"), directory, STEP).begun(
      str(tmp_step))
  rename = dir_fd.DirFd.rename

  def on_a_failing_disk(self, src, dst):  # the step's rename, in its directory opened
    if self.join(src) == str(tmp_step):
      raise OSError(errno.EIO, os.strerror(errno.EIO), self.join(src))
    return rename(self, src, dst)
  monkeypatch.setattr(dir_fd.DirFd, "rename", on_a_failing_disk)
  caplog.set_level(logging.INFO, logger="sidecar")
  for host, raw in enumerate(raws):
    stage(raw, host, directory, pathlib.Path(target.tmp_dir), target.final_dir)
  error = rejected(lambda: raws[0].ckpt.Commit(ckpt_pb.CheckpointCommitRequest(
      tmp_dir=target.tmp_dir, step=STEP, num_hosts=1, taken_over=True),
      metadata=raws[0].metadata, timeout=30))
  said = (f"host 0 could not write step {STEP}: Input/output error (EIO) writing "
          f"{tmp_step}; make room there (or save to another directory), then save again")
  e = protocol_lib.error_from_rpc(error, host="host 0")
  assert isinstance(e, errors.CheckpointWriteError), error.details()
  assert (str(e), e.errno, e.path, e.host_id) == (said, errno.EIO, str(tmp_step), 0)
  assert eventually(lambda: "abandoned by the sidecars, never listed" in caplog.text, 30)
  decided = [r.args[1] for r in caplog.records if "never listed" in r.getMessage()]
  # Each host's decision as it logged it: the committer's, then host 1's (told over Agree).
  assert [(type(d).__name__, str(d)) for d in decided] == [
      ("CheckpointWriteError", said)] * 2, decided
  assert [(d.errno, d.path, d.host_id) for d in decided] == [(errno.EIO, str(tmp_step), 0)] * 2
  assert not (pathlib.Path(directory) / str(STEP)).exists()


def test_a_step_committed_meanwhile_is_a_permission_denied_error_everywhere(
    two_hosts, tmp_path, monkeypatch, caplog):
  """Another checkpointer committed the step while the committer's commit was under way
  (its directory made just before the rename): the step is abandoned, and its error is the
  typed PermissionDeniedError naming the directory, with the fix, in the committer's
  decision, in host 1's (told over Agree) and at the trainer (it was a raw FileExistsError
  in the decisions)."""
  raws, _ = two_hosts
  directory = str(tmp_path / "ck")
  tmp_step = pathlib.Path(f"{directory}/{STEP}.orbax-checkpoint-tmp")
  target = Target.for_step(formats_lib.DEFAULT.get("orbax"), directory, STEP).begun(
      str(tmp_step))
  release = tmp_path / "release"
  monkeypatch.setenv(faults.FAULT_ENV, f"slowrename@{STEP}:{release}")
  caplog.set_level(logging.INFO, logger="sidecar")
  for host, raw in enumerate(raws):
    stage(raw, host, directory, pathlib.Path(target.tmp_dir), target.final_dir)
  assert eventually(lambda: (tmp_step / COMMIT_SUCCESS_FILE).is_file(), 30)
  final = pathlib.Path(directory) / str(STEP)
  final.mkdir()  # the other checkpointer's step
  release.touch()
  said = (f"commit: step {STEP} was committed meanwhile at {final}: another checkpointer "
          "made or committed it meanwhile (two jobs saving into one directory?); save each "
          "step of a directory from one checkpointer")
  error = rejected(lambda: raws[0].ckpt.Commit(ckpt_pb.CheckpointCommitRequest(
      tmp_dir=target.tmp_dir, step=STEP, num_hosts=1, taken_over=True),
      metadata=raws[0].metadata, timeout=30))
  e = protocol_lib.error_from_rpc(error, host="host 0")
  assert isinstance(e, errors.PermissionDeniedError), error.details()
  assert str(e) == said
  assert eventually(lambda: "abandoned by the sidecars, never listed" in caplog.text, 30)
  decided = [r.args[1] for r in caplog.records if "never listed" in r.getMessage()]
  assert [(type(d).__name__, str(d)) for d in decided] == [
      ("PermissionDeniedError", said)] * 2, decided
  assert list(final.iterdir()) == []  # theirs, untouched
