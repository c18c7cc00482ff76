"""Discovery against real grpc.health.v1 servers on loopback (its env parsing: tests/unit)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sidecar._src.controller import discovery
from sidecar._src.core import errors
from tests.support.jobset_env import JOBSET_ENV

pytestmark = pytest.mark.server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@contextlib.contextmanager
def health_server(status=SERVING, *, host="127.0.0.1", port=0):
  """A real health server; yields (servicer, port)."""
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
  servicer = health.HealthServicer()
  servicer.set("", status)
  health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
  bound = server.add_insecure_port(f"{host}:{port}")
  assert bound, f"could not bind {host}:{port}"
  server.start()
  try:
    yield servicer, bound
  finally:
    server.stop(grace=None)


def closed_port() -> int:
  """A port nothing listens on (bound, then released)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_discover_returns_grpc_addresses_in_host_order_when_all_serve():
  with health_server() as (_, h0), health_server() as (_, h1), health_server() as (_, h2):
    env = {"SIDECAR_HOSTS": f"127.0.0.1:5000:{h0},127.0.0.1:5001:{h1},127.0.0.1:5002:{h2}"}
    assert discovery.discover(timeout=10, env=env) == [
        "127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"]


def test_discover_follows_the_jobset_naming_to_distinct_servers():
  # Every 127.x.y.z is loopback on Linux, so a template can give each (slice, host) its own
  # address with one shared health port, as JobSet pods have.
  with health_server(host="127.0.0.10") as (_, port):
    with (health_server(host="127.0.0.11", port=port), health_server(host="127.0.1.10", port=port),
          health_server(host="127.0.1.11", port=port)):
      env = dict(JOBSET_ENV, SIDECAR_HOSTS_PER_SLICE="2", SIDECAR_HEALTH_PORT=str(port),
                 SIDECAR_HOST_TEMPLATE="127.0.{slice}.1{host}")
      assert discovery.discover(timeout=10, env=env) == [
          "127.0.0.10:8490", "127.0.0.11:8490", "127.0.1.10:8490", "127.0.1.11:8490"]


def test_discover_waits_for_a_sidecar_that_starts_late():
  port = closed_port()
  ready = threading.Event()

  def start_late():
    time.sleep(0.8)
    with health_server(port=port):
      ready.set()
      time.sleep(5)

  thread = threading.Thread(target=start_late, daemon=True)
  thread.start()
  start = time.monotonic()
  with health_server() as (_, early):
    env = {"SIDECAR_HOSTS": f"127.0.0.1:1:{early},127.0.0.1:2:{port}"}
    assert discovery.discover(timeout=20, env=env) == ["127.0.0.1:1", "127.0.0.1:2"]
  assert ready.is_set()
  assert time.monotonic() - start < 10, "a short reconnect backoff should notice it quickly"


def test_discover_lists_every_host_that_did_not_answer_with_its_last_error():
  dead = closed_port()
  with health_server() as (_, good), health_server(NOT_SERVING) as (_, sick):
    env = {"SIDECAR_HOSTS": f"127.0.0.1:1:{good},127.0.0.1:2:{sick},127.0.0.1:3:{dead}",
           "SIDECAR_HOSTS_PER_SLICE": "1"}
    start = time.monotonic()
    with pytest.raises(errors.DiscoveryError) as info:
      discovery.discover(timeout=1.0, env=env)
    elapsed = time.monotonic() - start
  message = str(info.value)
  assert "2 of 3 sidecars did not answer SERVING within 1s" in message
  assert f"slice 1 host 0 (127.0.0.1:{sick}): health status NOT_SERVING" in message
  assert f"slice 2 host 0 (127.0.0.1:{dead}): UNAVAILABLE" in message
  assert f"127.0.0.1:{good}" not in message
  assert 1.0 <= elapsed < 8.0


def test_a_host_that_recovers_before_the_deadline_is_not_listed():
  with health_server(NOT_SERVING) as (servicer, port):
    threading.Timer(0.5, servicer.set, args=("", SERVING)).start()
    assert discovery.discover(timeout=10, env={"SIDECAR_HOSTS": f"127.0.0.1:1:{port}"}) == [
        "127.0.0.1:1"]
