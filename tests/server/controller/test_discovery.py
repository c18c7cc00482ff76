"""Tests for discovery: env parsing without sockets, then real health servers on loopback."""

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

pytestmark = pytest.mark.server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

JOBSET_ENV = {
    "SIDECAR_JOBSET_NAME": "train",
    "SIDECAR_REPLICATED_JOB": "slice",
    "SIDECAR_NUM_SLICES": "2",
    "SIDECAR_HOSTS_PER_SLICE": "3",
}


# Tier 1: no sockets.


@pytest.mark.unit
def test_jobset_env_gives_jobset_hostnames_slice_major():
  found = discovery.endpoints_from_env(JOBSET_ENV)
  assert [e.address for e in found] == [
      "train-slice-0-0.train:8490", "train-slice-0-1.train:8490", "train-slice-0-2.train:8490",
      "train-slice-1-0.train:8490", "train-slice-1-1.train:8490", "train-slice-1-2.train:8490",
  ]
  assert [(e.slice_id, e.host_id) for e in found] == [(s, h) for s in range(2) for h in range(3)]
  assert {e.health_address.rsplit(":", 1)[1] for e in found} == {"8491"}


@pytest.mark.unit
def test_subdomain_ports_and_template_come_from_env():
  env = dict(JOBSET_ENV, SIDECAR_SUBDOMAIN="net", SIDECAR_PORT="9000",
             SIDECAR_HEALTH_PORT="9001", SIDECAR_NAMESPACE="ml",
             SIDECAR_HOST_TEMPLATE="{jobset}-{replicated_job}-{slice}-{host}.{subdomain}."
                                   "{namespace}.svc.cluster.local")
  found = discovery.endpoints_from_env(env)
  assert found[4].address == "train-slice-1-1.net.ml.svc.cluster.local:9000"
  assert found[4].health_address == "train-slice-1-1.net.ml.svc.cluster.local:9001"


@pytest.mark.unit
def test_default_subdomain_is_the_jobset_name():
  found = discovery.endpoints_from_env(dict(JOBSET_ENV, SIDECAR_SUBDOMAIN=""))
  assert found[0].host == "train-slice-0-0.train"


@pytest.mark.unit
def test_template_index_field_counts_slice_major():
  env = dict(JOBSET_ENV, SIDECAR_HOST_TEMPLATE="worker-{index}")
  assert [e.host for e in discovery.endpoints_from_env(env)] == [
      f"worker-{i}" for i in range(6)]


@pytest.mark.unit
def test_host_list_overrides_jobset_env_and_parses_ports():
  env = dict(JOBSET_ENV, SIDECAR_HOSTS="a, b:9000 ,c:9000:9001,[::1]:7000:7001",
             SIDECAR_HOSTS_PER_SLICE="2")
  found = discovery.endpoints_from_env(env)
  assert [(e.slice_id, e.host_id) for e in found] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  assert [e.address for e in found] == ["a:8490", "b:9000", "c:9000", "[::1]:7000"]
  assert [e.health_address for e in found] == ["a:8491", "b:8491", "c:9001", "[::1]:7001"]


@pytest.mark.unit
def test_host_list_without_hosts_per_slice_is_one_slice():
  found = discovery.endpoints_from_env({"SIDECAR_HOSTS": "a,b,c"})
  assert [(e.slice_id, e.host_id) for e in found] == [(0, 0), (0, 1), (0, 2)]


@pytest.mark.unit
@pytest.mark.parametrize("env, match", [
    ({}, r"SIDECAR_JOBSET_NAME, SIDECAR_REPLICATED_JOB, SIDECAR_NUM_SLICES, "
         r"SIDECAR_HOSTS_PER_SLICE not set\. Set SIDECAR_HOSTS"),
    ({"SIDECAR_JOBSET_NAME": "t"}, r"SIDECAR_REPLICATED_JOB, .* not set"),
    (dict(JOBSET_ENV, SIDECAR_NUM_SLICES="two"),
     r"SIDECAR_NUM_SLICES must be an integer >= 1, got 'two'"),
    (dict(JOBSET_ENV, SIDECAR_HOSTS_PER_SLICE="0"),
     r"SIDECAR_HOSTS_PER_SLICE must be an integer >= 1, got '0'"),
    (dict(JOBSET_ENV, SIDECAR_HEALTH_PORT="70000"),
     r"SIDECAR_HEALTH_PORT must be an integer in 1\.\.65535, got '70000'"),
    (dict(JOBSET_ENV, SIDECAR_HOST_TEMPLATE="{pod}"),
     r"SIDECAR_HOST_TEMPLATE '\{pod\}' is not a valid template .* use the fields"),
    ({"SIDECAR_HOSTS": "a,,b"}, r"SIDECAR_HOSTS has an empty entry"),
    ({"SIDECAR_HOSTS": "a:1:2:3"}, r"entry 'a:1:2:3' is not HOST\[:PORT\[:HEALTH_PORT\]\]"),
    ({"SIDECAR_HOSTS": "::1"}, r"entry '::1' is not HOST.*put IPv6 addresses in brackets"),
    ({"SIDECAR_HOSTS": "[::1"}, r"entry '\[::1' is malformed"),
    ({"SIDECAR_HOSTS": "a:http"}, r"entry 'a:http' has port 'http'; ports are integers"),
    ({"SIDECAR_HOSTS": "a,b,c", "SIDECAR_HOSTS_PER_SLICE": "2"},
     r"lists 3 hosts, not a multiple of SIDECAR_HOSTS_PER_SLICE=2"),
], ids=["empty", "partial-jobset", "bad-slices", "zero-hosts", "bad-port", "bad-template",
        "empty-entry", "too-many-colons", "bare-ipv6", "open-bracket", "named-port",
        "ragged-slices"])
def test_malformed_env_names_the_variable_and_the_fix(env, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    discovery.endpoints_from_env(env)


@pytest.mark.unit
def test_discovery_error_is_a_timeout_error():
  assert issubclass(errors.DiscoveryError, TimeoutError)
  assert issubclass(errors.DiscoveryError, errors.SidecarError)


# Tier 2: real grpc.health.v1 servers on loopback.


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


@pytest.mark.unit
def test_negative_timeout_is_rejected():
  with pytest.raises(errors.InvalidArgumentError, match=r"timeout must be >= 0 seconds, got -1"):
    discovery.discover(timeout=-1, env={"SIDECAR_HOSTS": "127.0.0.1"})
