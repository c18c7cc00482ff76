"""Tier 1: the checkpoint client (client.CheckpointClient) against a fake connection, no
sockets: its close() cancels and joins the retries of a busy sidecar's calls."""

import concurrent.futures
import threading

import grpc
import pytest

from sidecar._src.controller.checkpoint.client import CheckpointClient
from sidecar._src.controller.connection import CallWindow
from sidecar._src.core import errors
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


def ours(prefix: str) -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


class BusyRpcError(grpc.RpcError):
  """What a sidecar whose checkpoint slots are all taken answers."""

  def code(self):
    return grpc.StatusCode.RESOURCE_EXHAUSTED

  def details(self):
    return "busy"

  def trailing_metadata(self):
    info = pb.Error(type="BusyError", message="every checkpoint slot is taken")
    return ((protocol._ERROR_KEY, info.SerializeToString()),)


class BusyMethod:
  def future(self, request, *, timeout, metadata):
    out: concurrent.futures.Future = concurrent.futures.Future()
    out.set_exception(BusyRpcError())
    return out


class BusyConnection:
  address, metadata = "fake:0", ()

  def __init__(self):
    self.checkpoint_calls = CallWindow(8, name=self.address)
    self.checkpoint = type("Stub", (), {"Open": BusyMethod()})()


def test_close_cancels_and_joins_the_busy_retries_and_fails_their_calls():
  conn = BusyConnection()
  client = CheckpointClient(select=list, connection=lambda h: conn, worker=lambda h: None,
                            status=lambda **kw: [], timeout=30)
  opened = client.open(0, "/ckpt/run", ram_steps=1, ram_budget=None, sweep=False)
  assert ours("sidecar-ckpt-retry")  # asked again shortly, on a timer
  client.close()
  assert ours("sidecar-ckpt-retry") == []
  with pytest.raises(errors.ClosedError, match="closed while a busy sidecar"):
    opened.result(5)
  client.close()  # idempotent
  conn.checkpoint_calls.close()
