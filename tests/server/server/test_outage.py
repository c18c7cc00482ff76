"""Tier 2: the side ports and the worker socket under floods of idle connections (issue 23,
items 1 and 2): bounded, timed out, and health says when a listener is gone."""

import socket
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import eventually

pytestmark = pytest.mark.server


def health(port: int) -> int:
  with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                timeout=10).status


def test_health_says_not_serving_once_the_worker_socket_cannot_accept(make_server):
  server = make_server()
  assert health(server.health_port) == health_pb2.HealthCheckResponse.SERVING
  assert server.workers.alive
  server.workers._sock.shutdown(socket.SHUT_RDWR)  # accept() fails with EINVAL: for good
  assert eventually(lambda: not server.workers.alive)
  assert health(server.health_port) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_closing_the_listener_joins_its_accept_thread(make_server):
  server = make_server()
  thread = server.workers._thread
  server.workers.close()
  assert not thread.is_alive()


def idle(port: int, n: int) -> list[socket.socket]:
  """``n`` TCP connections to ``port`` that never send a byte."""
  return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def ended(conns: list[socket.socket]) -> int:
  """How many of ``conns`` the server closed (EOF, or reset; GOAWAY bytes read past)."""
  n = 0
  for c in conns:
    c.setblocking(False)
    try:
      while True:
        data = c.recv(1 << 16)
        if not data:
          n += 1
          break
    except BlockingIOError:
      pass
    except ConnectionResetError:
      n += 1
  return n


def close(conns: list[socket.socket]) -> None:
  for c in conns:
    c.close()


def test_idle_connections_to_the_metrics_port_are_capped_and_timed_out(make_server,
                                                                       monkeypatch):
  import urllib.request

  from sidecar._src.server import metrics_server
  monkeypatch.setattr(metrics_server, "READ_TIMEOUT_S", 1.0)
  server = make_server(metrics_port=0)
  threads = threading.active_count()
  conns = idle(server.metrics_port, 200)
  try:
    assert eventually(lambda: ended(conns) >= 200 - metrics_server.MAX_CONNECTIONS, timeout=10)
    assert threading.active_count() - threads <= metrics_server.MAX_CONNECTIONS  # not 200
    assert eventually(lambda: ended(conns) == 200, timeout=10)  # each idle one let go
    assert eventually(lambda: threading.active_count() <= threads)
  finally:
    close(conns)
  url = f"http://127.0.0.1:{server.metrics_port}/metrics"
  assert b"sidecar_arena_size_bytes" in urllib.request.urlopen(url, timeout=10).read()


@pytest.mark.parametrize("port", ["health_port", "port"])
def test_idle_connections_to_the_grpc_ports_are_capped_and_timed_out(make_server, port):
  from sidecar._src.server.server import HEALTH_CONNECTIONS
  server = make_server(max_connections=8, handshake_timeout_s=1.0)
  cap = HEALTH_CONNECTIONS if port == "health_port" else 8
  conns = idle(getattr(server, port), cap + 20)
  try:
    assert eventually(lambda: ended(conns) >= 20, timeout=10)  # past the cap: closed at once
    assert eventually(lambda: ended(conns) == cap + 20, timeout=10)  # no handshake: closed
  finally:
    close(conns)
  assert health(server.health_port) == health_pb2.HealthCheckResponse.SERVING
  import sidecar
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl:
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
