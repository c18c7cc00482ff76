"""Connecting to a sidecar: an address where none listens fails at once, with gRPC's
reason; one that accepts and never answers waits out the connect timeout (issue 22, 11)."""

import contextlib
import socket

import pytest

import sidecar
from sidecar._src.core import address as address_lib

pytestmark = pytest.mark.server


@contextlib.contextmanager
def _port(*, listening: bool):
  """A loopback port: free (a connection is refused), or listening without a server."""
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  if listening:
    s.listen()
  else:
    s.close()
  try:
    yield port
  finally:
    s.close()


def test_a_refused_connection_fails_with_the_resolved_address_and_grpcs_reason():
  with _port(listening=False) as port:
    # Before: the full connect timeout, then "did not answer within 300 s".
    with pytest.raises(sidecar.HostLostError,
                       match=rf"cannot reach sidecar localhost:{port}: .*ipv[46]:.*{port}.*"
                             "Connection refused.*is `sidecar serve` running there"):
      sidecar.jax.Controller([f"localhost:{port}"], connect_timeout=300)


def test_a_host_that_accepts_and_never_answers_waits_out_the_connect_timeout():
  with _port(listening=True) as port:
    with pytest.raises(sidecar.HostLostError,
                       match=rf"sidecar 127.0.0.1:{port} did not answer within 1 s"):
      sidecar.jax.Controller([f"127.0.0.1:{port}"], connect_timeout=1)


def test_one_refused_address_among_several_is_named():
  with _port(listening=False) as a, _port(listening=False) as b:
    with pytest.raises(sidecar.HostLostError) as info:
      sidecar.jax.Controller([f"127.0.0.1:{a}", f"127.0.0.1:{b}"], connect_timeout=300)
  assert f"127.0.0.1:{a}" in str(info.value) and f"127.0.0.1:{b}" in str(info.value)


def test_the_health_port_given_as_the_control_address_is_named_as_such(make_server):
  server = make_server()
  # Before: RemoteError: StatusCode.UNIMPLEMENTED: Method not found!
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=rf"127.0.0.1:{server.health_port} answers gRPC but serves no sidecar "
                           r"control service .*looks like a sidecar's health port; give its "
                           r"control port instead \(sidecar serve --port"):
    sidecar.jax.Controller([f"127.0.0.1:{server.health_port}"], connect_timeout=30)


def test_a_wrong_token_is_named_once_with_its_type(make_server):
  server = make_server(token="s3cret")
  with pytest.raises(sidecar.AuthenticationError) as info:
    sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token="wrong", connect_timeout=30)
  # Before: "AuthenticationError: AuthenticationError: missing or wrong token ... host None)".
  assert str(info.value).startswith("missing or wrong token; present the job's token")
  assert str(info.value).endswith(f"(sidecar 127.0.0.1:{server.port})")


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_a_socket_path_without_unix_is_refused_naming_its_unix_spelling(make_server, tmp_path,
                                                                         monkeypatch, relative):
  server = make_server(listen=f"unix:{tmp_path / 'grpc.sock'}")
  assert server.options.unix
  monkeypatch.chdir(tmp_path)
  path = "grpc.sock" if relative else str(tmp_path / "grpc.sock")
  # Before: a DNS error ("Domain name not found") and "is `sidecar serve` running there";
  # then a HostLostError once dialled. An address that can never answer is no lost host.
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=rf"sidecar address '{path}' is a path, not unix:PATH or HOST:PORT: a "
                           rf"sidecar on a Unix socket is unix:{path}"):
    sidecar.jax.Controller([path], connect_timeout=30)
  with sidecar.jax.Controller([f"unix:{path}"], connect_timeout=30, attach=False) as ctl:
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]


@pytest.mark.parametrize("address,match", [
    ("127.0.0.1:70000", r"sidecar address '127.0.0.1:70000' has port '70000'; ports are "
                        r"integers in 1\.\.65535"),
    ("localhost:0", r"sidecar address 'localhost:0' has port '0'"),
    ("localhost", r"sidecar address 'localhost' has no port; write unix:PATH or HOST:PORT"),
], ids=["port-over-65535", "port-0", "no-port"])
def test_an_address_that_can_never_answer_is_refused_naming_the_form(address, match):
  # Before: gRPC dialled 70000 modulo 65536 (4464), and "localhost" on port 443.
  with pytest.raises(sidecar.InvalidArgumentError, match=match):
    sidecar.jax.Controller(["127.0.0.1:1", address], connect_timeout=300)


def no_such_name() -> str:
  """A host name that does not exist (RFC 6761's .invalid); skips where this machine's
  resolver cannot say so now (no DNS: "try again", which is waited for)."""
  name = "sidecar-test-host.invalid"
  if address_lib.unresolvable(name) is None:
    pytest.skip(f"this machine's resolver does not answer that {name} does not exist")
  return name


def test_a_host_name_that_does_not_resolve_is_refused_at_once():
  name = no_such_name()
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=rf"sidecar addresses: {name}:8490 \(.+\): no such host name, so no "
                           r"sidecar can ever answer there; give HOST:PORT with a host name this "
                           r"machine resolves \(or an IP address\), or unix:PATH"):
    sidecar.jax.Controller([f"{name}:8490"], connect_timeout=300)


@pytest.mark.parametrize("entry", ["{name}", "{name}:8490:8491", "127.0.0.1:8490,{name}:1"])
def test_sidecar_hosts_naming_no_host_is_refused_at_once_not_waited_for(monkeypatch, entry):
  # Issue 62 item 6: retried for the whole timeout (300 s), then "did not answer SERVING".
  entry = entry.format(name=no_such_name())
  monkeypatch.setenv("SIDECAR_HOSTS", entry)
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"SIDECAR_HOSTS: sidecar-test-host.invalid:\d+ \(.+\): no such host "
                           r"name"):
    sidecar.jax.Controller.from_env(timeout=300)


def test_a_host_that_resolves_and_is_not_up_is_still_waited_for(monkeypatch):
  with _port(listening=False) as port:
    monkeypatch.setenv("SIDECAR_HOSTS", f"localhost:{port}:{port}")
    with pytest.raises(sidecar.DiscoveryError, match=r"did not answer SERVING within 1s"):
      sidecar.jax.Controller.from_env(timeout=1)


def test_a_controller_told_no_ticket_says_so_once(make_server, tmp_path, caplog):
  """Issue 54, item 3: a Controller that the abstract socket tells no pid ticket asks for
  one in its handshake; a sidecar that tells none there either (here one that keeps no
  fetched tickets, as an older sidecar) leaves its sessions with every ticketless client
  of its tenant, and the Controller says so, once, instead of going on silently."""
  from sidecar._src.controller import connection

  path = tmp_path / "g.sock"
  server = make_server(listen=f"unix:{path}", token="t")
  server._client_ids.close()  # no pid ticket: as from another network namespace
  server.service._fetched = None  # and none in the handshake: as an older sidecar
  with caplog.at_level("WARNING", logger=connection.__name__):
    with sidecar.jax.Controller([f"unix:{path}"], token="t", timeout=10, attach=False) as ctl:
      ctl._sidecars.conns[0].renew()
      assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
  said = [r.getMessage() for r in caplog.records if "told this process no ticket" in
          r.getMessage()]
  assert len(said) == 1 and f"unix:{path}" in said[0], said
