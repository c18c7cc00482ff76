import socket

import pytest

from sidecar._src.tools import cli

pytestmark = pytest.mark.server


def test_a_serving_sidecar_is_healthy(make_server, capsys):
  server = make_server()
  assert cli.main(["health", f"127.0.0.1:{server.health_port}"]) == 0
  assert capsys.readouterr().out == f"127.0.0.1:{server.health_port}: SERVING\n"


def test_the_port_comes_from_the_environment_as_serve_takes_it(make_server, capsys,
                                                                monkeypatch):
  server = make_server()
  monkeypatch.setenv("SIDECAR_HEALTH_PORT", str(server.health_port))
  assert cli.main(["health"]) == 0
  assert "SERVING" in capsys.readouterr().out


def test_a_stopped_sidecar_is_not_healthy_and_says_why(make_server, capsys):
  server = make_server()
  port = server.health_port
  server.stop(grace=0)
  assert cli.main(["health", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
  assert capsys.readouterr().err.startswith(f"127.0.0.1:{port}: UNAVAILABLE: ")


def test_a_port_that_is_not_grpc_is_not_healthy(capsys):
  with socket.socket() as s:  # accepts, never speaks HTTP/2
    s.bind(("127.0.0.1", 0))
    s.listen()
    assert cli.main(["health", f"127.0.0.1:{s.getsockname()[1]}", "--timeout", "1"]) == 1
  assert capsys.readouterr().err.startswith("127.0.0.1:")
