"""Tier 2: a step's Abort and its commit on one sidecar are one at a time (the step's own
``commit_gate.CommitGate``). A trainer aborts a step the sidecars took over
while its committer commits it (a process failed after every part was staged): the abort
waits for the commit's end and is told the step is committed, removing nothing of it; an
abort that comes first makes the commit refuse the step, by name, never half done.

A real in-process sidecar and real files; the commit is held inside itself by the fault
points ``slowrename@STEP:PATH`` (its files in place, its rename to come) and
``slowcommit@STEP:PATH`` (decided, nothing of it written yet) until the test makes PATH.
"""

import logging
import pathlib

import grpc
import numpy as np
import pytest

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.ckptfmt.records import MANIFEST_FILE, CommitPlan, Manifest
from sidecar._src.ckptfmt.spec import COMMIT_SUCCESS_FILE, LeafKind, LeafSpec
from sidecar._src.server.checkpoint import faults
from sidecar._src.wire import checkpoint_wire as wire, protocol
from sidecar._src.wire.protocol import ckpt_pb
from tests.conftest import eventually
from tests.support.raw_client import Raw, rejected
from tests.support.staged import staged

pytestmark = pytest.mark.server

STEP = 1


class Trainer:
  """One trainer's save of step 1 of ``directory`` on one sidecar, sent by hand."""

  def __init__(self, raw: Raw, directory: str):
    self.raw, self.directory = raw, directory
    self.tmp = pathlib.Path(f"{directory}/{STEP}.orbax-checkpoint-tmp")
    self.item, self.final_dir = self.tmp / "default", f"{directory}/{STEP}/default"
    self.listed()

  def stage(self) -> None:
    """Its one Stage: it begins the step and carries its plan, so the sidecars take it
    over and commit it themselves (one host, its own committer)."""
    leaf = LeafSpec(key_path=("w",), shape=(8,), dtype=np.dtype(np.float32),
                    kind=LeafKind.NUMPY)
    request = ckpt_pb.CheckpointStageRequest(
        directory=self.directory, step=STEP, tmp_dir=str(self.item), final_dir=self.final_dir,
        leaves=[wire.leaf_to_pb(leaf)], last=True, begin_format="orbax")
    wire.plan_to_pb(request.plan, CommitPlan(save="save-1", committer=0, hosts=(0,), lead=True))
    wire.staged_to_pb(request, [staged(("w",), 0, ((0, 8),), np.arange(8, dtype=np.float32))],
                      None)
    self.raw.ckpt.Stage(request, metadata=self.raw.metadata, timeout=10)

  def abort(self, tmp_dir: pathlib.Path) -> grpc.Future:
    return self.raw.ckpt.Abort.future(ckpt_pb.CheckpointAbortRequest(
        tmp_dir=str(tmp_dir), final_dir=self.final_dir), metadata=self.raw.metadata, timeout=60)

  def commit(self) -> str:
    """The sidecars' decision, as the trainer waits for it (a Commit taken_over)."""
    return self.raw.ckpt.Commit(ckpt_pb.CheckpointCommitRequest(
        tmp_dir=str(self.item), step=STEP, num_hosts=1, taken_over=True),
        metadata=self.raw.metadata, timeout=30).committed

  def listed(self) -> list[int]:
    """The steps an Open lists (its RAM tier keeps the newest, as a Checkpointer's)."""
    return list(self.raw.ckpt.Open(ckpt_pb.CheckpointOpenRequest(
        directory=self.directory, ram_steps=1), metadata=self.raw.metadata, timeout=30).steps)


@pytest.fixture
def trainer(make_server, tmp_path):
  raw = Raw(make_server(token="t").port, token="t")
  yield Trainer(raw, str(tmp_path / "ck"))
  raw.close()


@pytest.mark.parametrize("aborts", [("item",), ("item", "step")],
                         ids=["its-item", "its-item-then-its-step"])
def test_an_abort_during_the_commits_renames_waits_and_is_told_it_is_committed(
    trainer, tmp_path, monkeypatch, caplog, aborts):
  """The controller aborts the item on every host, then the whole step directory: each
  Abort that meets the commit between its first file and its rename waits for its end."""
  release = tmp_path / "release"
  monkeypatch.setenv(faults.FAULT_ENV, f"slowrename@{STEP}:{release}")
  caplog.set_level(logging.INFO, logger="sidecar")
  trainer.stage()
  # Held inside the commit: every file in place, the step's rename to come.
  assert eventually(lambda: (trainer.tmp / COMMIT_SUCCESS_FILE).is_file(), 30)
  sent = [trainer.abort(trainer.item)]
  assert eventually(lambda: sent[0].done() or "waits for its commit" in caplog.text, 30)
  if "step" in aborts and sent[0].done():  # the controller's second, once the first answered
    sent.append(trainer.abort(trainer.tmp))
  release.touch()
  answers = [sent[0].result()]
  if "step" in aborts:
    answers.append((sent[1] if len(sent) > 1 else trainer.abort(trainer.tmp)).result())
  final = pathlib.Path(trainer.directory) / str(STEP)
  # The step the sidecars committed is whole: listed, its item with every file it lists.
  assert trainer.commit() == str(final)
  manifest = Manifest.from_json((final / "default" / MANIFEST_FILE).read_bytes(), "manifest")
  formats_lib.DEFAULT.get("orbax").check_stored(str(final / "default"), manifest)
  assert trainer.listed() == [STEP]
  # And each abort was told so: nothing of it removed.
  assert [a.committed for a in answers] == [str(final)] * len(answers)
  assert not list(pathlib.Path(trainer.directory).glob(".*sidecar-deleting*"))


def test_a_commit_after_its_abort_is_refused_by_name(trainer, tmp_path, monkeypatch, caplog):
  """The committer decided to commit (every part written), then the trainers' abort came
  first: the commit refuses the aborted step, and nothing of it is committed."""
  release = tmp_path / "release"
  monkeypatch.setenv(faults.FAULT_ENV, f"slowcommit@{STEP}:{release}")
  caplog.set_level(logging.INFO, logger="sidecar")
  trainer.stage()
  assert eventually(lambda: f"holding slowcommit of step {STEP}" in caplog.text, 30)
  assert trainer.abort(trainer.item).result().committed == ""  # aborted: its files go
  release.touch()
  error = rejected(trainer.commit)
  e = protocol.error_from_rpc(error, host="h")
  assert type(e).__name__ == "ClosedError", error.details()
  assert str(e).startswith(f"commit: the save of step {STEP} at '{trainer.final_dir}' was "
                           "aborted by its trainers before its commit began: it is not "
                           "committed"), str(e)
  assert not (pathlib.Path(trainer.directory) / str(STEP)).exists()
  assert trainer.listed() == []
