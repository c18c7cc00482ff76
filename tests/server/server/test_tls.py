"""Tier 2: TLS and mTLS on the control port (test certificates in tests/data/tls, to 2126)."""

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import sidecar
from sidecar._src.core import options as options_lib
from tests.support.tls import CA, CLIENT, CLIENT_KEY, SERVER, SERVER_KEY

pytestmark = pytest.mark.server

def controller(server, **kw):
  kw.setdefault("attach", False)  # over gRPC: through the TLS channel
  return sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10, **kw)


def test_tls_serves_a_controller_that_trusts_its_ca_and_no_plaintext_one(make_server):
  server = make_server(tls_cert=SERVER, tls_key=SERVER_KEY)
  with controller(server, tls_ca=CA) as ctl:
    x = np.arange(1 << 16, dtype=np.float32)  # inline: 256 KiB through TLS
    np.testing.assert_array_equal(ctl.call("echo", args=(x,))[0], x)
    with ctl.stream("echo_items", args=(3, 2)) as s:
      assert list(s) == [3, 3]
  with pytest.raises(sidecar.HostLostError, match="needs tls_ca"):
    controller(server, connect_timeout=1)
  with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:  # health: plaintext
    assert health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_mtls_refuses_a_controller_without_a_certificate(make_server, monkeypatch):
  server = make_server(tls_cert=SERVER, tls_key=SERVER_KEY, tls_client_ca=CA)
  with pytest.raises(sidecar.HostLostError):
    controller(server, tls_ca=CA, connect_timeout=1)
  monkeypatch.setenv("SIDECAR_TLS_CA", CA)  # the environment, as on Kubernetes
  monkeypatch.setenv("SIDECAR_TLS_CLIENT_CERT", CLIENT)
  monkeypatch.setenv("SIDECAR_TLS_CLIENT_KEY", CLIENT_KEY)
  with controller(server) as ctl:
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]


def test_tls_options_are_checked():
  with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
    options_lib.ServerOptions(tls_cert=SERVER)
  with pytest.raises(ValueError, match="tls_client_ca .* needs TLS"):
    options_lib.ServerOptions(tls_client_ca=CA)
  with pytest.raises(ValueError, match="no token is set"):  # TLS alone authenticates nobody
    options_lib.ServerOptions(listen="0.0.0.0", tls_cert=SERVER, tls_key=SERVER_KEY)
  # mTLS authenticates every client, as a token does: any interface is allowed.
  options_lib.ServerOptions(listen="0.0.0.0", tls_cert=SERVER, tls_key=SERVER_KEY, tls_client_ca=CA)
  with pytest.raises(sidecar.InvalidArgumentError, match="tls_cert and tls_key go together"):
    sidecar.jax.Controller(["127.0.0.1:1"], tls_cert=CLIENT)


def test_sidecar_status_reaches_a_tls_sidecar_with_the_ca_in_the_environment(make_server,
                                                                           monkeypatch):
  from sidecar._src.controller import status as status_lib
  server = make_server(tls_cert=SERVER, tls_key=SERVER_KEY)
  with pytest.raises(sidecar.SidecarError):
    status_lib.fetch(f"127.0.0.1:{server.port}", timeout=2)  # plaintext against TLS
  monkeypatch.setenv("SIDECAR_TLS_CA", CA)
  reply = status_lib.fetch(f"127.0.0.1:{server.port}", timeout=10)
  assert reply.identity.host_id == 0
