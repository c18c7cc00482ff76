"""Tier 2: a save's Begin that loses the race to another checkpointer of its directory (two
jobs, each its own sidecar) answers the documented "is being saved by another
checkpointer", not a raw ``CheckpointWriteError: Begin: FileExistsError`` (issue 63
item 5), as a Stage that begins its step does (issue 69, item 5)."""

import pathlib

import grpc
import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt.spec import LeafKind, LeafSpec
from sidecar._src.server.checkpoint import faults
from sidecar._src.wire import checkpoint_wire as wire
from sidecar._src.wire.protocol import ckpt_pb
from tests.support.raw_client import Raw, rejected
from tests.support.staged import staged

pytestmark = pytest.mark.server


def test_a_step_another_job_committed_meanwhile_is_refused_by_name(make_server, tmp_path):
  ours, theirs = make_server(), make_server()  # two jobs' sidecars, one directory
  directory = tmp_path / "ck"
  state = {"w": np.arange(8, dtype=np.float32)}
  with sidecar.jax.Controller([f"127.0.0.1:{ours.port}"]) as a, \
      sidecar.jax.Controller([f"127.0.0.1:{theirs.port}"]) as b, \
      a.checkpointer(directory) as mine, b.checkpointer(directory) as other:
    assert other.save(1, {"w": state["w"] + 1}).durable.result(30) == 1  # theirs won
    with pytest.raises(sidecar.PermissionDeniedError) as info:
      mine.save(1, state).durable.result(30)
    message = str(info.value)
    assert message.startswith(f"begin: step 1 of '{directory}' is being saved by another "
                              f"checkpointer, or was: step 1 is already committed at "
                              f"{directory}/1; a save never replaces a committed step")
    assert "FileExistsError" not in message and "builtins" not in message
    assert mine.save(2, state).durable.result(30) == 2  # and ours saves on
  with sidecar.jax.Controller([f"127.0.0.1:{ours.port}"]) as a, a.checkpointer(directory) as c:
    np.testing.assert_array_equal(c.restore(1, target=state)["w"], state["w"] + 1)


def begin_stage(raw: Raw, directory: str, tmp_dir: str, *, final_step: int = 1):
  """A Stage that begins step 1 of ``directory`` itself (begin_format), writing ``tmp_dir``
  (to be step ``final_step``'s once committed); its one leaf ``w``, 8 float32."""
  leaf = LeafSpec(key_path=("w",), shape=(8,), dtype=np.dtype(np.float32),
                  kind=LeafKind.NUMPY)
  request = ckpt_pb.CheckpointStageRequest(
      directory=directory, step=1, tmp_dir=tmp_dir,
      final_dir=f"{directory}/{final_step}/default",
      leaves=[wire.leaf_to_pb(leaf)], last=True, begin_format="orbax")
  wire.staged_to_pb(request, [staged(("w",), 0, ((0, 8),), np.ones(8, np.float32))], None)
  return raw.ckpt.Stage(request, metadata=raw.metadata, timeout=10)


def test_a_stage_that_begins_its_step_writes_only_where_begin_would(make_server, tmp_path,
                                                                   monkeypatch):
  """A Stage may begin its step (one round trip less: issue 69, item 5); one that names a
  tmp_dir elsewhere is refused before anything is made, one whose part is refused leaves
  nothing begun, and one as the trainer sends it stages the step."""
  # Its write is held until `release` exists: a raw Stage names no worker, so the step is
  # in flight only while it is written, and the other session's Begin must meet it there.
  release = tmp_path / "release"
  monkeypatch.setenv(faults.FAULT_ENV, f"slow@1:{release}")
  server = make_server(token="t")
  raw = Raw(server.port, token="t")
  directory = str(tmp_path / "ck")
  tmp = f"{directory}/1.orbax-checkpoint-tmp"
  try:
    raw.ckpt.Open(ckpt_pb.CheckpointOpenRequest(directory=directory), metadata=raw.metadata,
                  timeout=10)
    error = rejected(lambda: begin_stage(raw, directory, f"{directory}/2.orbax-checkpoint-tmp"
                                                          "/default"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "is not where a save of step 1" in error.details()
    assert not pathlib.Path(tmp).exists()
    # Begun, then its part refused (its final_dir is not where tmp_dir goes): undone.
    error = rejected(lambda: begin_stage(raw, directory, f"{tmp}/default", final_step=2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "is not where tmp_dir" in error.details()
    assert not pathlib.Path(tmp).exists()
    assert begin_stage(raw, directory, f"{tmp}/default").staged_bytes == 32
    assert pathlib.Path(tmp).is_dir()
    # Begun now: another session's Begin of the step is refused as before.
    other = Raw(server.port, token="t")
    try:
      error = rejected(lambda: other.ckpt.Begin(ckpt_pb.CheckpointBeginRequest(
          directory=directory, step=1, format="orbax"), metadata=other.metadata, timeout=10))
      assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    finally:
      other.close()
    release.touch()
    # Released, its write ends: the step is written in the directory the Stage made.
    written = raw.ckpt.Prepared(ckpt_pb.CheckpointPreparedRequest(
        final_dir=f"{directory}/1/default", timeout_s=10), metadata=raw.metadata, timeout=20)
    assert len(written.records) == 1 and pathlib.Path(tmp).is_dir()
  finally:
    raw.close()
