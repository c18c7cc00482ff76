"""Tier 1: the checkpoint client (client.CheckpointClient) against a fake connection, no
sockets: its close() cancels and joins the retries of a busy sidecar's calls; a Stage that
begins its step is a blocking call on the thread that waits for it."""

import concurrent.futures
import threading

import grpc
import pytest

from sidecar._src.ckptfmt.save_values import Begin, Stage
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


class StageMethod:
  """A Stage stub: answered at once, blocking (``__call__``) or as a future, each call's
  kind and thread recorded; the first ``busy`` calls are answered busy."""

  def __init__(self, busy=0):
    self.calls, self.busy = [], busy

  def _answer(self, kind):
    self.calls.append((kind, threading.current_thread().name))
    if len(self.calls) <= self.busy:
      raise BusyRpcError()
    return type("StageResponse", (), {"staged_bytes": 32})()

  def __call__(self, request, *, timeout, metadata):
    return self._answer("blocking")

  def future(self, request, *, timeout, metadata):
    out: concurrent.futures.Future = concurrent.futures.Future()
    try:
      out.set_result(self._answer("future"))
    except grpc.RpcError as e:
      out.set_exception(e)
    return out


def stage_on(method, *, begin_format, thread="finisher"):
  """``client.stage`` of an empty last part on a connection whose Stage is ``method``, on a
  thread named ``thread`` (``main``: this one); its answer, and whether it was answered as
  it returned."""
  conn = BusyConnection()
  conn.checkpoint = type("Stub", (), {"Stage": method})()
  client = CheckpointClient(select=list, connection=lambda h: conn, worker=lambda h: None,
                            status=lambda **kw: [], timeout=30)
  got = []

  def stage():
    f = client.send(0, Stage(directory="/ckpt", step=1,
                              tmp_dir="/ckpt/1.orbax-checkpoint-tmp/default",
                              final_dir="/ckpt/1/default", leaves=[], shards=[], last=True,
                              begin=Begin("/ckpt", 1, begin_format) if begin_format else None))
    got.append((f, f.done()))
  if thread == "main":
    stage()
  else:
    t = threading.Thread(target=stage, name=thread)
    t.start()
    t.join(30)
  try:
    return got[0][0].result(5), got[0][1]
  finally:
    client.close()
    conn.checkpoint_calls.close()


def test_a_stage_that_begins_its_step_is_called_on_the_thread_that_waits_for_it():
  # Issue 69 item 5: save() waits for that Stage's answer; a blocking call on the
  # finisher's thread starts no thread of gRPC's to wait for it, and hands nothing over.
  method = StageMethod()
  answered, done = stage_on(method, begin_format="orbax")
  assert done and answered == 32 and method.calls == [("blocking", "finisher")]
  # Another part (nobody waits for it at once), or on the main thread (which Ctrl-C must
  # be able to leave): sent as a future, as before.
  for begin_format, thread in (("", "finisher"), ("orbax", "main")):
    method = StageMethod()
    answered, _ = stage_on(method, begin_format=begin_format, thread=thread)
    assert answered == 32 and [k for k, _ in method.calls] == ["future"]


def test_a_busy_host_is_asked_again_after_a_blocking_stage():
  method = StageMethod(busy=1)
  answered, done = stage_on(method, begin_format="orbax")
  assert not done  # asked again shortly, on a timer, as any busy call
  assert answered == 32 and [k for k, _ in method.calls] == ["blocking", "future"]
