"""The Controller as one of N trainer processes, against one in-process sidecar.

The other processes are a fake coordination client's other threads; the
multi-process tier (tests/multiprocess) runs the real thing.
"""

import pytest

import sidecar
from sidecar._src.jax import distributed
from tests.support.fake_coordination import FakeCoordinationClient

pytestmark = pytest.mark.server


def peers(index=0, count=2):
  return distributed.JaxPeers(FakeCoordinationClient(), index=index, count=count)


def test_a_process_whose_own_sidecar_is_unreachable_gets_a_discovery_error(
    make_server, monkeypatch, tmp_path):
  server = make_server()
  gone = tmp_path / "gone.sock"
  monkeypatch.setenv("SIDECAR_ADDRESS", f"unix://{gone}")
  with pytest.raises(sidecar.DiscoveryError,
                     match=f"process 0: its own sidecar at unix://{gone} is unreachable"):
    sidecar.jax.Controller([f"127.0.0.1:{server.port}"], peers=peers())


def test_a_process_must_know_its_own_sidecar(make_server, monkeypatch):
  server = make_server()
  monkeypatch.delenv("SIDECAR_ADDRESS", raising=False)
  with pytest.raises(sidecar.InvalidArgumentError, match="set SIDECAR_ADDRESS=unix://"):
    sidecar.jax.Controller([f"127.0.0.1:{server.port}"], peers=peers())


def test_calls_run_on_the_own_host_by_default(make_server, monkeypatch):
  servers = [make_server(host_id=h) for h in range(2)]
  monkeypatch.setenv("SIDECAR_ADDRESS", f"unix://{servers[1].options.socket_path}")
  client = FakeCoordinationClient()
  # The other process has published its host already: host 0, with other devices.
  client.key_value_set("sidecar/controller/hosts/0", '{"host_id": 0, "device_ids": [2048]}')
  with sidecar.jax.Controller([f"127.0.0.1:{s.port}" for s in servers],
                          peers=distributed.JaxPeers(client, index=1, count=2)) as ctl:
    assert ctl.multiprocess and ctl.process_index == 1
    assert ctl.local_hosts == [1]
    assert ctl.call("add", args=(2, 3)) == [5]
    assert ctl.call("add", args=(1, 1), hosts=[0, 1]) == [2, 2]
    assert ctl.device_hosts[2048] == 0
    assert set(ctl.device_hosts.values()) == {0, 1}
    assert ctl.worker(1) is not None and ctl.worker(0) is None
