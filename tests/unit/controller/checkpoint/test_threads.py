"""Tier 1: every thread a checkpointer starts is joined by its close() (fakes, no sockets)."""

import concurrent.futures
import threading

import grpc
import numpy as np
import pytest

from sidecar._src.controller.checkpoint.client import CheckpointClient
from sidecar._src.controller.connection import CallWindow
from sidecar._src.core import errors
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb
from tests.support.fake_sidecars import FakeSidecars, checkpointer

pytestmark = pytest.mark.unit


def ours(prefix: str) -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


class SlowReplicas(FakeSidecars):
  """Replication that ends when the test says (``replicated[step].set()``)."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.pending: list[tuple[str, concurrent.futures.Future]] = []

  def replicate(self, host, final_dir, peers, *, bandwidth, timeout):
    self.calls.append(("replicate", host))
    out: concurrent.futures.Future = concurrent.futures.Future()
    self.pending.append((final_dir, out))
    return out

  def finish(self, step: int) -> None:
    for item, f in self.pending:
      if f"/{step}/" in item + "/" and not f.done():
        f.set_result({"peers": [], "shards": 0, "bytes": 0, "seconds": 0.0})


def test_close_joins_an_older_saves_finisher_still_settling_its_replication():
  """With replicas, save 1's finisher waits for its replication after durable, while
  save 2 runs: it was no longer the SaveCoordinator's, and close() did not wait for it."""
  fake = SlowReplicas(hosts=(0, 1))
  ckpt = checkpointer(fake, hosts=[0, 1], replicas=1)
  assert ckpt.save(1, {"x": np.ones(3, np.float32)}).durable.result(30) == 1
  second = ckpt.save(2, {"x": np.ones(3, np.float32)})
  assert second.durable.result(30) == 2
  fake.finish(2)
  assert second.replicated.result(30) == 2
  closing = threading.Thread(target=ckpt.close, name="test-close")
  closing.start()
  closing.join(0.5)
  assert closing.is_alive()  # step 1's finisher still settles: close waits for it
  fake.finish(1)
  closing.join(30)
  assert not closing.is_alive() and ours("sidecar-save-") == []


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
