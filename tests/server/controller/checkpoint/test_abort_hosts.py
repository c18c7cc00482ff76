"""Tier 2: the trainers' abort of a step that several sidecars save into one directory
never damages the step their committer commits meanwhile (``SaveProtocol.abort``).

Two real in-process sidecars (hosts 0 and 1) on one checkpoint directory, each with its
part of step 1, which they took over (its committer: host 0). The committer is held inside
its commit by the fault point ``slowrename@STEP:PATH`` (every file in place, the step's
rename to come) while the lead trainer aborts the step on every host, as its controller
does: host 1's files lie in the very item the committer is about to rename.
"""

import logging
import pathlib
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.ckptfmt.records import MANIFEST_FILE, CommitPlan, Manifest
from sidecar._src.ckptfmt.spec import COMMIT_SUCCESS_FILE, LeafKind, LeafSpec
from sidecar._src.controller.checkpoint.client import CheckpointClient
from sidecar._src.controller.checkpoint.save_protocol import SaveProtocol, Target
from sidecar._src.controller.connection import CallWindow
from sidecar._src.server.checkpoint import faults
from sidecar._src.wire import checkpoint_wire as wire
from sidecar._src.wire.protocol import ckpt_pb
from tests.conftest import eventually
from tests.support.raw_client import Raw
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
  eventually(lambda: not item.is_dir(), 3)  # (a removal by another host would be done by now)
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
