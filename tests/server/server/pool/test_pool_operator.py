"""Tier 2: the pool's operator token (``operator_token_file``; issue 42 item 4, issue 45
item 5): no tenant; it reads every tenant's row of Status and nothing else runs with it; the
peer token sees no row; a reload puts a new operator token in force and ends the old one."""

import grpc
import numpy as np
import pytest

import sidecar
from sidecar._src.arena.worker import Worker
from sidecar._src.core import errors
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import ckpt_pb, pb
from tests.conftest import PEER_TOKEN
from tests.support import pool_files
from tests.support.pool_files import ALICE, BOB, OPERATOR, controller, write_pool
from tests.support.raw_client import Raw, rejected

pytestmark = pytest.mark.server

DENIED = "this is the pool's operator token"


def _status(raw: Raw) -> pb.StatusResponse:
  status = raw.channel.unary_unary(f"/{protocol.SERVICE}/Status",
                                   request_serializer=pb.StatusRequest.SerializeToString,
                                   response_deserializer=pb.StatusResponse.FromString)
  return status(pb.StatusRequest(), metadata=raw.metadata, timeout=10)


def test_the_operator_sees_every_row_and_runs_nothing(make_server, tmp_path):
  server = make_server(pool=write_pool(tmp_path, pool_files.POOL + pool_files.OPERATOR_LINE))
  run = str(tmp_path / "alice" / "run")
  with controller(server, ALICE) as alice, controller(server, BOB):
    with alice.checkpointer(run) as ck:
      ck.save(1, {"w": np.arange(1024, dtype=np.float32)}).durable.result(30)
    with controller(server, OPERATOR) as operator:  # the public API
      (status,) = operator.status()
      assert [t.name for t in status.tenants] == ["alice", "bob"]
      assert [t.sessions for t in status.tenants] == [1, 1]
      assert run in [c.directory for c in status.checkpoints]  # everyone's directories
      with pytest.raises(errors.PermissionDeniedError, match=f"Call: {DENIED}"):
        operator.call("add", args=(1,), kwargs={"b": 2})
      with pytest.raises(errors.PermissionDeniedError, match=f"Open: {DENIED}"):
        operator.checkpointer(str(tmp_path / "bob" / "mine"))
    peer = Raw(server.port, token=PEER_TOKEN)  # the sidecars' own: no row, no directory
    seen = _status(peer)
    assert (list(seen.tenants), list(seen.checkpoints)) == ([], [])
    peer.close()
  raw = Raw(server.port, token=OPERATOR)  # the wire, with none of the Controller's checks
  for attempt, what in (
      (lambda: raw.call("add", pb.Value(int_value=1), b=2), "Call"),
      (lambda: raw.feed("nothing", pb.FeedSpec()), "Stream"),
      (lambda: raw.ckpt.Begin(ckpt_pb.CheckpointBeginRequest(directory=run, step=2),
                              metadata=raw.metadata, timeout=10), "Begin"),
      (lambda: raw.ckpt.Read(ckpt_pb.CheckpointReadRequest(final_dir=run + "/1/default"),
                             metadata=raw.metadata, timeout=10), "Read")):
    error = rejected(attempt)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    assert f"{what}: {DENIED}" in error.details()
  raw.close()
  with pytest.raises(sidecar.AuthenticationError,
                     match=r"the pool's operator token \(.*pool.yaml:\d+\).*no worker attaches"):
    Worker(server.options.socket_path, token=OPERATOR)


def test_a_reload_puts_a_new_operator_token_in_force(make_server, tmp_path):
  path = write_pool(tmp_path, pool_files.POOL + pool_files.OPERATOR_LINE)
  server = make_server(pool=path)
  old = Raw(server.port, token=OPERATOR)
  assert [t.name for t in _status(old).tenants] == ["alice", "bob"]
  token_file = tmp_path / "operator.token"
  for bad, match in ((BOB, "is also the token of tenant 'bob'"),
                     (PEER_TOKEN, "is the sidecars' peer token")):
    token_file.write_text(bad + "\n")
    with pytest.raises(errors.InvalidArgumentError, match=match):
      server.reload()
    assert [t.name for t in _status(old).tenants] == ["alice", "bob"]  # nothing changed
  token_file.write_text("a-new-operator-token\n")
  server.reload()
  error = rejected(lambda: _status(old))
  assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error.details()
  assert "the operator token was changed in the pool file" in error.details()
  old.close()
  new = Raw(server.port, token="a-new-operator-token")
  assert [t.name for t in _status(new).tenants] == ["alice", "bob"]
  new.close()
