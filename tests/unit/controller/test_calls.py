"""``controller.calls.Calls`` with no process: the Call RPC is an in-process fake.

tests/support's :class:`FakeConnection` has a real CallWindow and a ``call_rpc`` that answers
each request at once: ``answer(request)`` is the CallResponse, or the RpcError raised.
No worker maps an arena here, so arguments and results travel inline.
"""

import os
import signal
import threading

import grpc
import numpy as np
import pytest

from sidecar._src.controller.calls import Calls
from sidecar._src.core import errors, interrupts
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb
from tests.conftest import eventually
from tests.support.fake_sidecars import FakeConnection

pytestmark = pytest.mark.unit


class Unavailable(grpc.RpcError):
  def code(self):
    return grpc.StatusCode.UNAVAILABLE

  def details(self):
    return "connection refused"


def _doubled(request: pb.CallRequest) -> pb.CallResponse:
  (x,) = codec.decode(request.args)
  return pb.CallResponse(result=codec.encode(x * 2))


def _calls(conn):
  calls = Calls(connection={0: conn}.__getitem__, worker=lambda host: None)
  _made.append(calls)
  return calls


_made: list[Calls] = []


@pytest.fixture(autouse=True)
def _calls_closed():
  """Each test's Calls closed after it, as a Controller's close() closes its own."""
  yield
  while _made:
    _made.pop().close()


def test_the_request_carries_the_arguments_inline_without_a_worker():
  held: list = []
  request = _calls(FakeConnection(answer=_doubled)).request(
      0, "double", (np.arange(3),), {"timeout": 5.0}, 1.0, held)
  assert request.name == "double" and request.worker_session == "" and held == []
  (x,) = codec.decode(request.args)
  np.testing.assert_array_equal(x, np.arange(3))
  assert codec.decode(request.kwargs) == {"timeout": 5.0}  # the user's, not ours


def test_a_name_that_is_no_str_is_refused():
  with pytest.raises(errors.InvalidArgumentError, match=r"name must be a str, got 3"):
    _calls(FakeConnection(answer=_doubled)).request(0, 3, (), {}, 1.0, [])


@pytest.mark.parametrize("on_main_thread", [True, False], ids=["main-thread", "other-thread"])
def test_a_sync_call_returns_the_result_and_its_slot(on_main_thread):
  conn = FakeConnection(answer=_doubled, window=1)
  calls, out = _calls(conn), []
  run = lambda: out.append(calls.call_sync(0, "double", (np.int64(21),), {}, 5.0))
  if on_main_thread:
    run()
  else:
    t = threading.Thread(target=run)
    t.start()
    t.join(5)
  assert out == [42]
  assert conn.calls.enter(0.0)  # the one slot is free again


def test_a_sync_call_that_waits_out_its_timeout_for_a_slot_names_it():
  conn = FakeConnection(answer=_doubled, window=1)
  assert conn.calls.enter(0.0)  # another call holds the only slot
  with pytest.raises(errors.DeadlineExceededError,
                     match=r"call 'double' on host 0 waited 0.01 s \(its timeout\) behind "
                           r"this controller's other calls to fake:1"):
    _calls(conn).call_sync(0, "double", (1,), {}, 0.01)
  assert conn.call_rpc.requests == []


def _unavailable(request):
  raise Unavailable()


def test_a_failed_rpc_becomes_the_matching_error_naming_the_host():
  conn = FakeConnection(answer=_unavailable)
  with pytest.raises(errors.HostLostError,
                     match=r"sidecar fake:1 \(host 0\) is unreachable: connection refused"):
    _calls(conn).call_sync(0, "double", (1,), {}, 5.0)
  future = _calls(conn).call_future(0, "double", (1,), {}, 5.0)
  with pytest.raises(errors.HostLostError, match=r"sidecar fake:1 \(host 0\)"):
    future.result(5)
  assert conn.calls.enter(0.0)  # neither kept its slot


def test_a_future_call_resolves_to_the_result():
  future = _calls(FakeConnection(answer=_doubled)).call_future(0, "double", (np.int64(4),), {}, 5.0)
  assert future.result(5) == 8


def test_a_future_call_that_cannot_encode_fails_its_future():
  future = _calls(FakeConnection(answer=_doubled)).call_future(0, 3, (), {}, 5.0)
  with pytest.raises(errors.InvalidArgumentError, match=r"name must be a str"):
    future.result(5)


def test_main_thread_calls_are_made_by_one_long_lived_thread_that_close_joins():
  made_on = []

  def answer(request):
    made_on.append(threading.current_thread())
    return _doubled(request)
  calls = _calls(FakeConnection(answer=answer))
  assert [calls.call_sync(0, "double", (np.int64(i),), {}, 5.0) for i in range(5)] == [
      0, 2, 4, 6, 8]
  (thread,) = set(made_on)  # not one thread a call (gRPC's futures), nor the main thread
  assert thread is not threading.main_thread() and thread.name.startswith("sidecar-call")
  calls.close()
  assert not thread.is_alive()
  calls.close()  # idempotent
  with pytest.raises(errors.ClosedError, match="closed"):
    calls.call_sync(0, "double", (np.int64(1),), {}, 5.0)


def test_ctrl_c_leaves_a_main_thread_call_running_and_drops_its_result():
  release, started, answered = threading.Event(), threading.Event(), []

  def answer(request):
    (x,) = codec.decode(request.args)
    if x == 1:  # the call Ctrl-C leaves
      started.set()
      release.wait(10)
    answered.append(int(x))
    return _doubled(request)
  conn = FakeConnection(answer=answer, window=2)
  calls = _calls(conn)
  threading.Timer(0.0, lambda: started.wait(5) and os.kill(os.getpid(), signal.SIGINT)).start()
  with pytest.raises(KeyboardInterrupt), interrupts.deferred():
    calls.call_sync(0, "double", (np.int64(1),), {}, 30.0)
  assert answered == []  # it goes on
  assert calls.call_sync(0, "double", (np.int64(2),), {}, 5.0) == 4  # on another thread
  assert conn.calls.enter(0.0) and not conn.calls.enter(0.0)  # the left call holds 1 of 2
  conn.calls.exit()
  release.set()
  assert eventually(lambda: answered == [2, 1])
  # Its slot came back: both of the window's slots can be taken (the second waits for it).
  # (Polling enter(0.0) would take the free slot on its first try and then race the release.)
  assert conn.calls.enter(0.0) and conn.calls.enter(5.0)
  conn.calls.exit()
  conn.calls.exit()
  calls.close()
