"""The attacks of issue 16 that need ``sidecar status``: an unauthenticated client learns
nothing."""

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar._src.wire import protocol
from tests.support.raw_client import rejected

pytestmark = pytest.mark.processes


def test_an_unauthenticated_client_learns_nothing_beyond_what_health_says(make_server, capsys,
                                                                            monkeypatch):
  import os
  import socket

  from sidecar._src.tools import cli
  server = make_server(token="s3cret")
  secrets = [socket.gethostname(), str(os.getpid()), server.identity.boot_id,
             server.options.socket_path]
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
    told = []
    for method in ("Handshake", "Status", "Call", "Leave", "Stalled"):
      told.append(rejected(lambda m=method: ch.unary_unary(f"/{protocol.SERVICE}/{m}")(
          b"", timeout=5)))
    told.append(rejected(lambda: list(ch.stream_stream(f"/{protocol.SERVICE}/Stream")(
        iter([b""]), timeout=5))))
    told.append(rejected(lambda: list(reflection_pb2_grpc.ServerReflectionStub(
        ch).ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=5))))
    for e in told:
      assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
      assert not [s for s in secrets if s in e.details() + str(e.trailing_metadata())]
  # `sidecar status` with the token (SIDECAR_TOKEN) gets all of it.
  assert cli.main(["status", f"127.0.0.1:{server.port}", "--json"]) == 1
  assert "AuthenticationError: " in capsys.readouterr().out
  monkeypatch.setenv("SIDECAR_TOKEN", "s3cret")
  assert cli.main(["status", f"127.0.0.1:{server.port}", "--json"]) == 0
  assert socket.gethostname() in capsys.readouterr().out
