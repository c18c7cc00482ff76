"""Tier 2: a sidecar serving gRPC, reflection and health on a Unix socket (--listen unix:)."""

import json
import os
import socket
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import sidecar
from sidecar._src.controller import discovery, status as status_lib
from sidecar._src.core import options as options_lib
from sidecar._src.server.server import Server
from sidecar._src.wire import protocol

pytestmark = pytest.mark.server


def _health(target: str) -> int:
  with grpc.insecure_channel(target) as ch:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_a_unix_sidecar_serves_calls_status_reflection_and_health_on_one_socket(make_server,
                                                                               tmp_path):
  path = tmp_path / "g.sock"
  server = make_server(listen=f"unix:{path}")
  assert (server.address, server.port, server.health_port) == (f"unix:{path}", 0, 0)
  assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
  with sidecar.jax.Controller([server.address]) as ctl:
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
    assert ctl.hosts[0].address == f"unix:{path}"
    assert ctl.worker(0) is not None  # the worker socket, beside it
  assert status_lib.fetch(server.address, timeout=10).identity.pid == os.getpid()
  assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING
  discovery.wait_until_serving(discovery.endpoints_from_env(
      {"SIDECAR_HOSTS": server.address}), timeout=10)
  with grpc.insecure_channel(server.address) as ch:
    reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
  names = {s.name for s in reply.list_services_response.service}
  assert {protocol.SERVICE, protocol.CHECKPOINT_SERVICE} <= names
  ready = tmp_path / "ready.json"
  server.write_ready_file(str(ready))
  assert json.loads(ready.read_text())["address"] == f"unix:{path}"
  server.stop(grace=0)
  assert not path.exists()  # its own socket file goes with it


def test_a_token_still_guards_the_services_but_not_health(make_server, tmp_path):
  server = make_server(listen=f"unix:{tmp_path}/g.sock", token="s3cret")
  with pytest.raises(sidecar.AuthenticationError, match="missing or wrong token"):
    sidecar.jax.Controller([server.address], token=None)
  with sidecar.jax.Controller([server.address], token="s3cret") as ctl:
    assert ctl.call("add", args=(1,), kwargs={"b": 1}) == [2]
  assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING


def test_socket_group_opens_the_socket_to_that_group(make_server, tmp_path):
  path = tmp_path / "g.sock"
  make_server(listen=f"unix:{path}", socket_group=str(os.getgid()))
  info = os.stat(path)
  assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == os.getgid()


def test_an_unknown_socket_group_is_named(make_server, tmp_path):
  with pytest.raises(OSError, match=r"--socket-group no-such-group-xyz: no such group"):
    make_server(listen=f"unix:{tmp_path}/g.sock", socket_group="no-such-group-xyz")
  assert not (tmp_path / "g.sock").exists()


def test_a_socket_left_by_a_killed_sidecar_is_replaced(make_server, tmp_path):
  path = tmp_path / "g.sock"
  with socket.socket(socket.AF_UNIX) as dead:  # bound, never listened: as after a SIGKILL
    dead.bind(str(path))
  server = make_server(listen=f"unix:{path}")
  assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING


def test_a_socket_a_live_sidecar_serves_is_refused_naming_its_pid(make_server, tmp_path):
  first = make_server(listen=f"unix:{tmp_path}/g.sock")
  with pytest.raises(OSError, match=rf"cannot make the gRPC socket {tmp_path}/g.sock: a live "
                     rf"process \(pid {os.getpid()}, another sidecar\?\) serves it; stop it, "
                     r"or give --listen unix:PATH another path"):
    make_server(listen=f"unix:{tmp_path}/g.sock")
  assert _health(first.address) == health_pb2.HealthCheckResponse.SERVING  # untouched


def test_a_worker_socket_a_live_sidecar_serves_is_refused_too(make_server, tmp_path):
  first = make_server()
  with pytest.raises(OSError, match=rf"worker socket {first.options.socket_path}: a live "
                     rf"process \(pid {os.getpid()}.*give --socket \(socket_path\) another"):
    Server(options_lib.ServerOptions(listen="127.0.0.1", port=0, health_port=0, shm_size=8 << 20,
                                 socket_path=first.options.socket_path)).start()
  with sidecar.jax.Worker(first.options.socket_path) as w:  # still the first sidecar's
    assert w.session


def test_a_file_that_is_not_a_socket_is_never_removed(make_server, tmp_path):
  (tmp_path / "g.sock").write_text("mine")
  with pytest.raises(OSError, match=r"a file that is not a socket is there; remove it, or give "
                     r"--listen unix:PATH another path"):
    make_server(listen=f"unix:{tmp_path}/g.sock")
  assert (tmp_path / "g.sock").read_text() == "mine"


def test_a_socket_directory_the_sidecar_cannot_write_is_named_before_the_arena(make_server,
                                                                              tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(NotADirectoryError, match=rf"cannot make the gRPC socket {tmp_path}/file/"
                     r"g.sock \(--listen unix:.*\): .*file is not a directory\. Give --listen a "
                     "unix: path in a directory this sidecar may write"):
    make_server(listen=f"unix:{tmp_path}/file/g.sock")


def test_a_missing_socket_directory_is_made_and_removed_again(make_server, tmp_path):
  server = make_server(listen=f"unix:{tmp_path}/a/b/g.sock")
  assert (tmp_path / "a" / "b").is_dir()
  server.stop(grace=0)
  assert not (tmp_path / "a").exists()


def test_a_client_of_a_socket_that_is_gone_says_what_to_start(tmp_path):
  with pytest.raises(sidecar.HostLostError, match=rf"cannot reach sidecar unix:{tmp_path}/g.sock"
                     r": .*is `sidecar serve --listen unix:.*` running\?"):
    sidecar.jax.Controller([f"unix:{tmp_path}/g.sock"], connect_timeout=5)


def test_a_socket_directory_others_may_write_is_refused_before_the_arena(make_server, tmp_path):
  """Issue 42, attack 6 (the sidecar's half): another user pre-made the directory, world-
  writable, to rename the socket away after start and listen at its name."""
  shared = tmp_path / "ww"
  shared.mkdir()
  shared.chmod(0o777)
  with pytest.raises(PermissionError, match=(
      rf"refusing to make the gRPC socket {shared}/g.sock: the directory {shared} \(owner uid "
      rf"{os.geteuid()}.*, mode 0777\) may be written by any user and is not sticky: another "
      r"user could rename the socket away and listen in its place, and clients would send it "
      r"their token\. Give --listen unix:PATH a path in a directory of this sidecar's user")):
    make_server(listen=f"unix:{shared}/g.sock")
  s = Server(options_lib.ServerOptions(listen="127.0.0.1", port=0, health_port=0, shm_size=8 << 20,
                                       socket_path=str(shared / "s.sock")))
  with pytest.raises(PermissionError, match=rf"refusing to make the worker socket {shared}/s.sock"
                     r": .*mode 0777.*Give --socket or \$SIDECAR_SOCKET a path"):
    s.start()
  assert not hasattr(s, "arena") and os.listdir(shared) == []  # refused first, nothing made
  s.stop()


def test_a_directory_the_operator_vouches_for_is_taken_as_tmp_is(make_server, tmp_path,
                                                                monkeypatch):
  """A pod's emptyDir is mode 2777, seen only by the pod's containers: the manifests name
  it in SIDECAR_SHARED_SOCKET_DIR."""
  shared = tmp_path / "emptydir"
  shared.mkdir()
  shared.chmod(0o2777)
  monkeypatch.setenv("SIDECAR_SHARED_SOCKET_DIR", str(shared))
  server = make_server(listen=f"unix:{shared}/g.sock")
  assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING


def test_a_pinned_socket_is_reached_however_its_name_is_taken_later(make_server, tmp_path):
  """A client's channel dials the socket it checked, not its name: an impostor that renames
  the sidecar's socket away and listens at the name gets none of its (re)connections."""
  from sidecar._src.wire import ipc
  path = tmp_path / "g.sock"
  make_server(listen=f"unix:{path}")
  with ipc.Pinned(str(path), timeout=5) as pin:
    assert (pin.server.pid, pin.server.uid) == (os.getpid(), os.getuid())
    os.rename(path, tmp_path / "away.sock")
    with socket.socket(socket.AF_UNIX) as impostor:
      impostor.bind(str(path))
      impostor.listen()
      impostor.setblocking(False)
      assert _health(pin.target) == health_pb2.HealthCheckResponse.SERVING
      with pytest.raises(BlockingIOError):
        impostor.accept()  # nobody dialled the name


def test_a_controller_lets_go_of_the_socket_it_pinned(make_server, tmp_path):
  path = tmp_path / "g.sock"
  make_server(listen=f"unix:{path}")

  def pinned() -> int:  # this process's descriptors of the socket file
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if _link(f"/proc/self/fd/{fd}") == str(path))

  with sidecar.jax.Controller([f"unix:{path}"], connect_timeout=10) as ctl:
    assert ctl.hosts[0].address == f"unix:{path}" and pinned() == 1
  status_lib.fetch(f"unix:{path}", timeout=10)
  assert pinned() == 0


def _link(path: str) -> str | None:
  try:
    return os.readlink(path)
  except OSError:
    return None
