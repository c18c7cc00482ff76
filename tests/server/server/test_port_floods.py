"""Tier 2: floods of the control and health ports by anyone who reaches them, without a
token (issue 76, attack round eight): raw HTTP/2 from another loopback peer
(``h2_flood.STRANGER``), while a client with the token (alice, on 127.0.0.1) connects anew.

The bounds are made small here (a few connections show what 2,048 did);
``tests/processes/server/test_port_floods.py`` holds the issue's own numbers against a
``sidecar serve`` with its defaults.
"""

import contextlib
import time

import grpc
import pytest

import sidecar
from sidecar._src.wire import protocol
from tests.support import h2_flood

pytestmark = pytest.mark.server
TOKEN = "alice-token-0123456789abcdef"


def alice_connects(server, timeout: float = 10.0) -> bool:
  return h2_flood.new_client(f"127.0.0.1:{server.port}", TOKEN, timeout=timeout)


def test_calls_without_a_token_whose_request_never_comes_hold_no_thread(make_server):
  """Before: 64 half-open calls on one connection held every server thread (19 here: 2
  threads, 1 stream, 16 checkpoint), and no client could handshake."""
  server = make_server(token=TOKEN, threads=2, max_streams=1)
  sock = h2_flood.connect(server.port)
  try:
    h2_flood.half_open(sock, f"/{protocol.SERVICE}/Status", 64)
    h2_flood.half_open(sock, f"/{protocol.SERVICE}/Call", 32, first=129,
                       metadata=((protocol.AUTH_KEY, "Bearer wrong"),))
    assert alice_connects(server, timeout=5)
  finally:
    h2_flood.close([sock])


def test_a_refused_call_says_why_having_read_nothing(make_server):
  server = make_server(token=TOKEN)
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
    status = channel.unary_unary(f"/{protocol.SERVICE}/Status")
    with pytest.raises(grpc.RpcError) as info:
      status(b"", timeout=5)
  assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
  assert "missing or wrong token" in info.value.details()


@pytest.fixture
def quick_scans(monkeypatch):
  from sidecar._src.server.ports import strangers
  monkeypatch.setattr(strangers, "SCAN_S", 0.1)
  monkeypatch.setattr(strangers, "BUSY_SCAN_S", 0.1)


@pytest.mark.parametrize("source", [h2_flood.STRANGER, "127.0.0.1"], ids=["another-peer",
                                                                           "alices-peer"])
def test_idle_connections_without_a_token_keep_no_new_client_out(make_server, quick_scans,
                                                                 source):
  """Attack 4: before, as many idle HTTP/2 connections as the port keeps locked every new
  client out (2,048 by default; 64 here), 15 s later as at once."""
  server = make_server(token=TOKEN, max_connections=64, handshake_timeout_s=2.0)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token=TOKEN) as before:
    flood = h2_flood.idle(server.port, 64, source=source)
    try:
      assert alice_connects(server)  # a new client
      assert before.call("add", args=(1,), kwargs={"b": 1}) == [2]  # and her old one
      # Past its peer's share at once (16), the rest after the grace: all gone.
      assert h2_flood.within(lambda: h2_flood.open_count(flood) == 0, 10) is not None
      assert before.call("add", args=(1,), kwargs={"b": 1}) == [2]  # never a stranger
    finally:
      h2_flood.close(flood)


def test_a_peer_keeps_few_strangers_and_the_oldest_go_first(make_server, quick_scans):
  from sidecar._src.server.ports import strangers
  server = make_server(token=TOKEN, handshake_timeout_s=60.0)
  old = h2_flood.idle(server.port, 10)
  assert h2_flood.within(lambda: server.strangers.scan() is not None and len(
      [c for c in server.strangers._known.values() if c]) >= 10, 5) is not None
  new = h2_flood.idle(server.port, strangers.STRANGERS_PER_REMOTE)
  try:
    assert h2_flood.within(lambda: h2_flood.open_count(old) == 0, 5) is not None
    assert h2_flood.open_count(new) == strangers.STRANGERS_PER_REMOTE
  finally:
    h2_flood.close(old + new)


def test_an_idle_connection_is_closed_and_its_client_connects_again(make_server):
  server = make_server(token=TOKEN, connection_idle_s=0.5)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token=TOKEN) as ctl:
    assert ctl.status()[0].arena_size > 0  # over gRPC
    accepted = lambda: list(server.strangers._connections(time.monotonic()).values())
    assert h2_flood.within(lambda: not accepted(), 10) is not None  # closed by the sidecar
    assert ctl.status()[0].arena_size > 0
    assert ctl.call("add", args=(2,), kwargs={"b": 4}) == [6]


# ---- the health port --------------------------------------------------------------------------


def test_watch_streams_without_a_token_keep_no_health_check_out(make_server):
  """Attack 3: before, 64 connections holding a Watch each took the health port (every
  new check refused, still 31 s later); now a new probe gets in, ahead of them."""
  server = make_server()
  held = h2_flood.watches(server.health_port, 64)
  try:
    for _ in range(3):
      assert h2_flood.check(server.health_port) == "SERVING"
  finally:
    for channel, _ in held:
      channel.close()


@pytest.mark.parametrize("source", [h2_flood.STRANGER, "127.0.0.1"], ids=["another-peer",
                                                                           "the-probes-peer"])
def test_idle_connections_keep_no_health_check_out(make_server, source):
  server = make_server()
  conns = h2_flood.idle(server.health_port, 200, source=source)
  try:
    assert h2_flood.check(server.health_port) == "SERVING"
    assert h2_flood.open_count(conns) <= 8  # its peer's share, the rest given way
  finally:
    h2_flood.close(conns)


def test_checks_whose_request_never_comes_keep_no_health_check_out(make_server):
  """A Check's request is read in a server thread: one that never comes held it. Each
  connection has one stream and a thread of its own now."""
  server = make_server()
  conns = h2_flood.idle(server.health_port, 8)
  for sock in conns:
    h2_flood.half_open(sock, "/grpc.health.v1.Health/Check", 16)
  try:
    assert h2_flood.check(server.health_port) == "SERVING"
  finally:
    h2_flood.close(conns)


def test_a_health_connection_is_closed_once_idle_or_old(make_server, monkeypatch):
  from sidecar._src.server.ports import health_port
  monkeypatch.setattr(health_port, "HEALTH_IDLE_S", 0.5)
  monkeypatch.setattr(health_port, "HEALTH_LIFE_S", 1.0)
  server = make_server()
  quiet = h2_flood.connect(server.health_port)
  talking = h2_flood.connect(server.health_port)
  try:
    with contextlib.suppress(OSError):  # a ping every 0.1 s: never idle, but old after 1 s
      for _ in range(12):
        talking.sendall(h2_flood.frame(6, 0, 0, b"12345678"))
        time.sleep(0.1)
    assert h2_flood.within(lambda: h2_flood.open_count([quiet, talking]) == 0, 5) is not None
    assert h2_flood.check(server.health_port) == "SERVING"
  finally:
    h2_flood.close([quiet, talking])


def test_watch_streams_are_bounded(make_server, tmp_path):
  from sidecar._src.server.ports import health
  server = make_server(listen=f"unix:{tmp_path}/grpc.sock")  # health on the one socket
  channel = grpc.insecure_channel(server.address)
  try:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    stub = health_pb2_grpc.HealthStub(channel)
    held = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(health.WATCHES)]
    for responses in held:
      assert next(responses).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
      next(stub.Watch(health_pb2.HealthCheckRequest()))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Watch streams open, its limit" in info.value.details()
    held.pop().cancel()  # one ends: its place comes back
    assert h2_flood.within(lambda: server._health.watching < health.WATCHES, 5) is not None
    assert next(stub.Watch(health_pb2.HealthCheckRequest())).status == (
        health_pb2.HealthCheckResponse.SERVING)
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == (
        health_pb2.HealthCheckResponse.SERVING)
  finally:
    channel.close()


# ---- the worker socket ------------------------------------------------------------------------


def test_silent_connections_keep_no_worker_out_of_the_worker_socket(make_server):
  """Before: connections that never said a first frame held every place for 10 s each
  (FIRST_FRAME_S), opened again as they closed: no worker could attach."""
  import socket

  from tests.conftest import eventually
  server = make_server(max_worker_connections=8)
  silent = []
  for _ in range(8):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.options.socket_path)
    silent.append(s)
  try:
    with sidecar.jax.Worker(server.options.socket_path, timeout=10) as w:
      assert w.session
      assert float(w.put(__import__("numpy").ones(8))[0].sum()) == 8.0
    assert eventually(lambda: h2_flood.open_count(silent) < 8)  # the oldest gave way
  finally:
    h2_flood.close(silent)


def test_the_health_servers_private_socket_goes_and_a_killed_ones_is_swept(make_server):
  import os
  import socket
  import tempfile
  import time

  from sidecar._src.server.ports import health_port
  stale, live = (tempfile.mkdtemp(prefix=health_port.INNER_PREFIX) for _ in range(2))
  listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  for directory, keep in ((stale, False), (live, True)):
    s = listening if keep else socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(os.path.join(directory, health_port.INNER_NAME))
    s.listen(1) if keep else s.close()  # a killed sidecar's socket: nobody listens
  old = time.time() - 2 * health_port.STALE_S  # a killed sidecar's, from before
  os.utime(os.path.join(stale, health_port.INNER_NAME), (old, old))
  try:
    server = make_server()
    assert not os.path.exists(stale) and os.path.exists(live)  # another's, live: kept
    mine = server._health_dir
    assert os.stat(mine).st_mode & 0o777 == 0o700
    server.stop()
    assert not os.path.exists(mine)
  finally:
    listening.close()
    health_port.remove_inner_dir(live)
