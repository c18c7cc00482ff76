"""ctl.call over a Worker's Unix socket (controller/socket_calls.py, the sidecar's ``calls``
connections in server/workers/workers.py) against an in-process sidecar."""

import socket
import threading
import time

import numpy as np
import pytest

import sidecar
from sidecar._src.core import errors
from sidecar._src.wire import codec, ipc
from sidecar._src.wire.protocol import pb
from tests.conftest import eventually
from tests.support import sidecar_fns

pytestmark = pytest.mark.server


def used(server) -> int:
  return server.leases.allocator.used_bytes


class NoGrpcCalls:
  """Stands for a connection's Call rpc: fails the test if a call goes over gRPC."""

  def __call__(self, *args, **kwargs):
    raise AssertionError("a call to an attached host went over gRPC")

  future = __call__


def test_a_call_to_an_attached_host_goes_over_its_socket_on_one_connection(make_server):
  server = make_server(shm_size=8 << 20)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    ctl._sidecars.conns[0].call_rpc = NoGrpcCalls()
    assert [ctl.call("add", args=(i,), kwargs={"b": 1}) for i in range(5)] == [[1], [2], [3],
                                                                               [4], [5]]
    (a,) = ctl.call("full", args=(1 << 20, 7))  # a view of the arena, leased to the worker
    assert isinstance(a, np.ndarray) and int(a[0]) == 7 and ctl.worker(0).live_blocks == 1
    arena = ctl.worker(0).arena.buffer
    assert arena.ctypes.data <= a.ctypes.data < arena.ctypes.data + arena.nbytes
    del a
    assert eventually(lambda: ctl.worker(0).live_blocks == 0)
    assert len(server.workers._connections) == 2  # the attach, and one lane for every call


def test_errors_over_the_socket_keep_their_kind_and_the_remote_traceback(make_server):
  server = make_server()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    with pytest.raises(sidecar.RemoteError, match="boom") as caught:
      ctl.call("fail", args=("boom",))
    assert "sidecar_fns.py" in caught.value.remote_traceback
    with pytest.raises(sidecar.NotRegisteredError, match="nope"):
      ctl.call("nope")
    with pytest.raises(sidecar.InvalidArgumentError, match="bad arguments"):
      ctl.call("add", args=(1, 2, 3))
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]  # the lane serves on


def test_a_call_past_its_timeout_raises_its_late_result_goes_back_and_the_next_works(
    make_server):
  server = make_server(shm_size=8 << 20)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    baseline = used(server)
    t0 = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="within its timeout of 0.2 s"):
      ctl.call("full", args=(1 << 20, 1, 3.0), timeout=0.2)
    assert time.monotonic() - t0 < 2.0  # well before the function's 3 s (0.6 s was noise)
    assert ctl.call("add", args=(1,)) == [1]  # on another lane, meanwhile
    # The late result came to the reader the call left behind, which let it go.
    assert eventually(lambda: used(server) == baseline, timeout=15)
    assert ctl._sidecars.conns[0].calls.enter(5.0)  # a slot is free (polling would take two)
    ctl._sidecars.conns[0].calls.exit()
    # A timeout that passes before the wait begins is a timeout too, not a lost host.
    with pytest.raises(errors.DeadlineExceededError):
      ctl.call("sleep", args=(0.3,), timeout=1e-5)
    (f,) = ctl.call_async("full", args=(1 << 20, 2, 0.6), timeout=0.2)  # the same, async
    with pytest.raises(errors.DeadlineExceededError, match="within its timeout of 0.2 s"):
      f.result(5)
    del f
    assert eventually(lambda: used(server) == baseline)
    assert ctl._sidecars.conns[0].calls.enter(5.0)  # a slot is free (polling would take two)
    ctl._sidecars.conns[0].calls.exit()


def test_close_ends_the_wait_for_a_left_calls_result(make_server):
  server = make_server()
  try:
    ctl = sidecar.jax.Controller([f"127.0.0.1:{server.port}"])
    with pytest.raises(errors.DeadlineExceededError):
      ctl.call("wait_gate", args=("close-while-left",), timeout=0.2)
    t0 = time.monotonic()
    ctl.close()  # its reader blocked on the lane: closed and joined (no thread left)
    assert time.monotonic() - t0 < 3
  finally:
    sidecar_fns.open_gate("close-while-left")
  assert eventually(lambda: sidecar_fns.waiting("close-while-left") == 0)


def lane(server, session: str) -> socket.socket:
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.settimeout(10)
  sock.connect(server.workers.path)
  ipc.send(sock, {"op": "calls", "session": session})
  return sock


def answer(sock: socket.socket) -> pb.CallResponse:
  return pb.CallResponse.FromString(ipc.recv_bytes(sock, limit=1 << 30))


def request(name: str, *args, session: str, timeout_s: float = 10.0) -> bytes:
  return pb.CallRequest(name=name, args=codec.encode(args), kwargs=codec.encode({}),
                        worker_session=session, timeout_s=timeout_s).SerializeToString()


def test_a_calls_connection_is_its_sessions_alone(make_server):
  server = make_server()
  with sidecar.jax.Worker(server.workers.path) as w:
    with lane(server, "w-nobody") as sock:  # no such session: answered, then closed
      reply = answer(sock)
      assert reply.error.type == "InvalidArgumentError"
      assert "unknown worker session" in reply.error.message
      assert sock.recv(1) == b""
    with lane(server, w.session) as sock:
      # Results leased to another session's blocks: refused, and the lane serves on.
      ipc.send_bytes(sock, request("add", 1, 2, session="w-" + "0" * 32))
      reply = answer(sock)
      assert reply.error.type == "InvalidArgumentError"
      assert "a connection's calls are its session's" in reply.error.message
      ipc.send_bytes(sock, request("add", 1, 2, session=w.session, timeout_s=-1))
      assert "timeout_s must be finite seconds >= 0" in answer(sock).error.message
      ipc.send_bytes(sock, b"\xff\xff\xff")  # not a CallRequest
      assert answer(sock).error.type == "InvalidArgumentError"
      ipc.send_bytes(sock, request("add", 1, 2, session=w.session))
      assert codec.decode(answer(sock).result) == 3
      # A frame past the limit: answered, and the connection ends (its bytes unread).
      sock.sendall((server.options.max_message_size + 1).to_bytes(4, "little"))
      assert "exceeds the limit" in answer(sock).error.message
      assert sock.recv(1) == b""
    with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
      assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]  # the sidecar serves on


def test_a_result_the_caller_is_gone_for_goes_back_to_the_arena(make_server):
  # The caller's lane closes while its call runs (its process died, or it closed): the
  # result's block, leased to a session that lives on, is given back when the answer
  # cannot be sent.
  server = make_server(shm_size=8 << 20)
  with sidecar.jax.Worker(server.workers.path) as w:
    baseline = used(server)
    sock = lane(server, w.session)
    ipc.send_bytes(sock, request("full", 1 << 20, 3, 0.5, session=w.session))
    time.sleep(0.1)
    sock.close()
    # Its thread ends once the answer could not be sent (the attach's connection stays).
    assert eventually(lambda: len(server.workers._connections) == 1, timeout=5)
    assert used(server) == baseline  # the result's block was made, then given back
    assert w.session in server.workers.pids()  # the worker's session lives on


def test_call_async_to_an_attached_host_goes_over_its_socket_too(make_server):
  server = make_server()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    ctl._sidecars.conns[0].call_rpc = NoGrpcCalls()
    futures = [ctl.call_async("add", args=(i,), kwargs={"b": 10})[0] for i in range(20)]
    assert [f.result(10) for f in futures] == [i + 10 for i in range(20)]
    (f,) = ctl.call_async("fail", args=("async boom",))
    with pytest.raises(sidecar.RemoteError, match="async boom"):
      f.result(10)


def test_several_threads_call_at_once_each_on_a_lane_of_its_own(make_server):
  server = make_server()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    ctl._sidecars.conns[0].call_rpc = NoGrpcCalls()
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(
        ctl.call("rendezvous", args=(3,), timeout=10))) for _ in range(3)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(15)
    assert results == [[True]] * 3  # all three inside the sidecar at once


@pytest.mark.parametrize("how", ["call", "call_async"])
def test_calls_left_at_their_timeout_give_their_slot_back_at_once(make_server, how):
  # Issue 35 item 7: nine calls abandoned at their timeout held the window's eight slots
  # until their functions ended, so the next call waited out its own timeout behind them
  # (over gRPC it answers at once). The slot goes back at the caller's deadline; the
  # arguments' blocks stay with the call until it ends.
  gate = f"left-at-timeout-{how}"
  server = make_server()
  try:
    with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
      ctl._sidecars.conns[0].call_rpc = NoGrpcCalls()
      for _ in range(9):
        with pytest.raises(errors.DeadlineExceededError):
          if how == "call":
            ctl.call("wait_gate", args=(gate,), timeout=0.1)
          else:
            ctl.call_async("wait_gate", args=(gate,), timeout=0.1)[0].result(5)
      # Each was sent (none timed out waiting for a slot), and each runs on.
      assert eventually(lambda: sidecar_fns.waiting(gate) == 9), sidecar_fns.waiting(gate)
      t0 = time.monotonic()
      assert ctl.call("add", args=(1,), timeout=30) == [1]
      assert time.monotonic() - t0 < 15  # not the 30 s of its timeout
      sidecar_fns.open_gate(gate)
      assert eventually(lambda: sidecar_fns.waiting(gate) == 0)
  finally:
    sidecar_fns.open_gate(gate)
