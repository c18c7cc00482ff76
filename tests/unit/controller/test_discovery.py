"""Discovery's env parsing, without sockets."""

from __future__ import annotations

import pytest

from sidecar._src.controller import discovery
from sidecar._src.core import errors, rendezvous
from tests.support.jobset_env import JOBSET_ENV

pytestmark = pytest.mark.unit


def test_jobset_env_gives_jobset_hostnames_slice_major():
  found = discovery.endpoints_from_env(JOBSET_ENV)
  assert [e.address for e in found] == [
      "train-slice-0-0.train:8490", "train-slice-0-1.train:8490", "train-slice-0-2.train:8490",
      "train-slice-1-0.train:8490", "train-slice-1-1.train:8490", "train-slice-1-2.train:8490",
  ]
  assert [(e.slice_id, e.host_id) for e in found] == [(s, h) for s in range(2) for h in range(3)]
  assert {e.health_address.rsplit(":", 1)[1] for e in found} == {"8491"}


def test_subdomain_ports_and_template_come_from_env():
  env = dict(JOBSET_ENV, SIDECAR_SUBDOMAIN="net", SIDECAR_PORT="9000",
             SIDECAR_HEALTH_PORT="9001", SIDECAR_NAMESPACE="ml",
             SIDECAR_HOST_TEMPLATE="{jobset}-{replicated_job}-{slice}-{host}.{subdomain}."
                                   "{namespace}.svc.cluster.local")
  found = discovery.endpoints_from_env(env)
  assert found[4].address == "train-slice-1-1.net.ml.svc.cluster.local:9000"
  assert found[4].health_address == "train-slice-1-1.net.ml.svc.cluster.local:9001"


def test_default_subdomain_is_the_jobset_name():
  found = discovery.endpoints_from_env(dict(JOBSET_ENV, SIDECAR_SUBDOMAIN=""))
  assert found[0].host == "train-slice-0-0.train"


def test_template_index_field_counts_slice_major():
  env = dict(JOBSET_ENV, SIDECAR_HOST_TEMPLATE="worker-{index}")
  assert [e.host for e in discovery.endpoints_from_env(env)] == [
      f"worker-{i}" for i in range(6)]


def test_host_list_overrides_jobset_env_and_parses_ports():
  env = dict(JOBSET_ENV, SIDECAR_HOSTS="a, b:9000 ,c:9000:9001,[::1]:7000:7001",
             SIDECAR_HOSTS_PER_SLICE="2")
  found = discovery.endpoints_from_env(env)
  assert [(e.slice_id, e.host_id) for e in found] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  assert [e.address for e in found] == ["a:8490", "b:9000", "c:9000", "[::1]:7000"]
  assert [e.health_address for e in found] == ["a:8491", "b:8491", "c:9001", "[::1]:7001"]


def test_host_list_takes_unix_sockets_whose_health_answers_on_the_same_socket():
  found = discovery.endpoints_from_env(
      {"SIDECAR_HOSTS": "unix:/run/s/h0.grpc,unix:///run/s/h1.grpc, node-2:9000:9001"})
  assert [e.address for e in found] == ["unix:/run/s/h0.grpc", "unix:/run/s/h1.grpc",
                                        "node-2:9000"]
  assert [e.health_address for e in found] == ["unix:/run/s/h0.grpc", "unix:/run/s/h1.grpc",
                                               "node-2:9001"]
  assert [e.host_id for e in found] == [0, 1, 2]


def test_a_unix_entry_over_the_socket_limit_is_named():
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"its path is 206 bytes, a Unix socket's may be at most 107"):
    discovery.endpoints_from_env({"SIDECAR_HOSTS": "unix:/" + "x" * 205})


def test_host_list_without_hosts_per_slice_is_one_slice():
  found = discovery.endpoints_from_env({"SIDECAR_HOSTS": "a,b,c"})
  assert [(e.slice_id, e.host_id) for e in found] == [(0, 0), (0, 1), (0, 2)]


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
    # Issue 62 item 6: a path without unix: was a host name, retried for 300 s.
    ({"SIDECAR_HOSTS": "/tmp/x/host0.grpc"},
     r"SIDECAR_HOSTS entry '/tmp/x/host0.grpc' is a path, not HOST\[:PORT\[:HEALTH_PORT\]\] "
     r"or unix:PATH: a sidecar on a Unix socket is unix:/tmp/x/host0.grpc"),
    ({"SIDECAR_HOSTS": "a:99999"}, r"entry 'a:99999' has port '99999'; ports are integers in "
                                   r"1\.\.65535"),
    ({"SIDECAR_HOSTS": "a:8490:0"}, r"entry 'a:8490:0' has port '0'"),
], ids=["empty", "partial-jobset", "bad-slices", "zero-hosts", "bad-port", "bad-template",
        "empty-entry", "too-many-colons", "bare-ipv6", "open-bracket", "named-port",
        "ragged-slices", "path-without-unix", "port-over-65535", "health-port-0"])
def test_malformed_env_names_the_variable_and_the_fix(env, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    discovery.endpoints_from_env(env)


def test_discovery_error_is_a_timeout_error():
  assert issubclass(errors.DiscoveryError, TimeoutError)
  assert issubclass(errors.DiscoveryError, errors.SidecarError)


def test_negative_timeout_is_rejected():
  with pytest.raises(errors.InvalidArgumentError, match=r"timeout must be >= 0 seconds, got -1"):
    discovery.discover(timeout=-1, env={"SIDECAR_HOSTS": "127.0.0.1"})


def test_a_cluster_file_whose_host_is_a_path_is_refused_naming_the_form(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", "")  # no squeue: no Slurm job to ask about
  token = tmp_path / "token"
  token.write_text("t")
  token.chmod(0o600)
  path = str(tmp_path / "cluster.env")
  rendezvous.ClusterFile("svc", "12", ("/run/svc/host0.grpc",), str(token)).write(path)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"entry '/run/svc/host0.grpc' is a path, not .*: a sidecar on a Unix "
                           r"socket is unix:/run/svc/host0.grpc"):
    discovery.from_cluster_file(path, timeout=300)
