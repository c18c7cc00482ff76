"""mTLS between sidecars: replicas go to peers over TLS (test certificates in tests/data/tls)."""

import pytest

import sidecar
from tests.support.tls import CA, CLIENT, CLIENT_KEY, SERVER, SERVER_KEY

pytestmark = pytest.mark.processes


def test_replicas_go_to_peers_over_mtls(tmp_path):
  """Two sidecars with mTLS: the replica of each host's shards reaches its peer over TLS
  (inline, as between machines), with the client certificate SIDECAR_TLS_CLIENT_* names."""
  import jax

  from tests.support.states import assert_same, state_on, target_on
  tls = ["--tls-cert", SERVER, "--tls-key", SERVER_KEY, "--tls-client-ca", CA]
  env = {"SIDECAR_REPLICA_SHM": "0", "SIDECAR_TLS_CA": CA, "SIDECAR_TLS_CLIENT_CERT": CLIENT,
         "SIDECAR_TLS_CLIENT_KEY": CLIENT_KEY}
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="32MiB",
                                    extra_args=tls, host_env={0: env, 1: env},
                                    transport="tcp") as cluster:  # TLS is TCP's
    devices = jax.devices()[:2]
    state = state_on(devices)
    mtls = dict(tls_ca=CA, tls_cert=CLIENT, tls_key=CLIENT_KEY)
    with cluster.controller(**mtls) as ctl, ctl.checkpointer(tmp_path / "ck", replicas=1) as ckpt:
      handle = ckpt.save(1, state)
      assert handle.durable.result(60) == 1 and handle.replicated.result(60) == 1
    assert "over gRPC" in cluster.log(0) and "over gRPC" in cluster.log(1)
    cluster.kill(1)
    with sidecar.jax.Controller(cluster.addresses[:1], **mtls) as ctl:
      with ctl.checkpointer(tmp_path / "ck") as ckpt:
        assert_same(ckpt.restore(1, target=target_on(devices[:1], state)), state)
        assert "replica:host0" in ckpt.last_restore_stats().shards
