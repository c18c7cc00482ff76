import os
import socket

import pytest

import sidecar
from sidecar._src.core import address as address_lib, errors

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text,want", [
    ("unix:/run/sidecar/grpc.sock", address_lib.Address(path="/run/sidecar/grpc.sock")),
    ("unix:///run/sidecar/grpc.sock", address_lib.Address(path="/run/sidecar/grpc.sock")),
    (" 10.0.0.7:8490 ", address_lib.Address(host="10.0.0.7", port=8490)),
    ("node-3.train:1", address_lib.Address(host="node-3.train", port=1)),
    ("[::1]:8490", address_lib.Address(host="::1", port=8490)),
], ids=["unix", "unix-triple-slash", "ipv4", "name", "ipv6"])
def test_parse_reads_each_form(text, want):
  assert address_lib.parse(text) == want
  assert address_lib.parse(want.target) == want  # the target reads back as itself


def test_a_relative_unix_path_is_made_absolute():
  assert address_lib.parse("unix:g.sock").path == os.path.join(os.getcwd(), "g.sock")


def test_a_bare_host_takes_the_default_port():
  assert address_lib.parse("node-3", default_port=8490).target == "node-3:8490"
  assert address_lib.parse("[fe80::1]", default_port=8490).target == "[fe80::1]:8490"


@pytest.mark.parametrize("text,match", [
    ("unix:", r"a unix: address needs a path"),
    ("unix://run/x.sock", r"unix:// takes an absolute path \(unix:///run/x.sock\)"),
    ("::1:8490", r"put an IPv6 address in brackets"),
    ("[::1", r"is malformed; write unix:PATH or HOST:PORT"),
    ("node-3", r"'node-3' has no port"),
    ("node-3:http", r"has port 'http'; ports are integers in 1..65535"),
    ("node-3:0", r"has port '0'"),
    (":8490", r"names no host"),
    # Before: "put an IPv6 address in brackets", for a host with its health port added.
    ("node-3:8490:8491", r"it has 2 ports; give the control port alone, as node-3:PORT"),
    ("fe80::1:8490", r"put an IPv6 address in brackets"),
    ("node-3:a:b", r"holds more than one ':'"),
    # Before: "has no port", or a DNS error from gRPC, for a socket without unix:.
    ("/run/sidecar/grpc.sock", r"is a path, not .*: a sidecar on a Unix socket is "
                               r"unix:/run/sidecar/grpc.sock"),
], ids=["empty-path", "relative-double-slash", "bare-ipv6", "bracket", "no-port", "named-port",
        "port-0", "no-host", "health-port-added", "ipv6-with-port", "colons", "socket-path"])
def test_malformed_addresses_name_the_text_and_the_forms(text, match):
  with pytest.raises(sidecar.InvalidArgumentError, match=match):
    address_lib.parse(text, what="address")


@pytest.mark.parametrize("text", ["node-3:8490:8491", "node-3:a:b", "/run/sidecar/grpc.sock"])
def test_an_address_that_is_no_ipv6_one_gets_no_word_on_ipv6(text):
  # Before: HOST:PORT:HEALTH was told the forms with "(IPv6 in brackets: [::1]:8490)",
  # advice for a mistake the user did not make (issue 45 item 6).
  with pytest.raises(sidecar.InvalidArgumentError) as e:
    address_lib.parse(text, what="address")
  assert "IPv6" not in str(e.value) and "unix:PATH or HOST:PORT" in str(e.value)


def test_a_unix_path_over_the_limit_names_its_length_the_limit_and_the_fix():
  path = "/tmp/" + "d" * 100 + "/grpc.sock"
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=rf"{path}: its path is {len(path)} bytes, a Unix socket's may be at "
                           r"most 107; use a shorter path"):
    address_lib.parse(f"unix:{path}")
  assert address_lib.parse("unix:/" + "d" * 106).path  # 107 bytes: the longest that binds


def test_is_unix_tells_the_forms_apart():
  assert address_lib.is_unix("unix:/x") and address_lib.is_unix(" unix:///x")
  assert not address_lib.is_unix("127.0.0.1:8490") and not address_lib.is_unix("unixhost:1")


def test_access_to_a_socket_that_is_not_there_yet_is_left_to_the_connection(tmp_path):
  address_lib.check_access(f"unix:{tmp_path}/none.sock")  # gRPC says "No such file" itself
  address_lib.check_access("127.0.0.1:1")  # TCP: nothing to check


def test_a_socket_this_process_may_not_open_names_the_path_and_its_mode(tmp_path, monkeypatch):
  path = tmp_path / "g.sock"
  path.write_text("")
  path.chmod(0o400)
  # The kernel's answer for a user without write permission (root, who runs CI, may open
  # every file; tests/processes/tools/test_unix_transport.py drops that power for real).
  monkeypatch.setattr(address_lib.os, "access", lambda p, mode: False)
  with pytest.raises(errors.PermissionDeniedError,
                     match=rf"unix:{path}: permission denied: {path} is a file, not a socket, "
                           r"of mode 0400, owner uid \d+.*--socket-group"):
    address_lib.check_access(f"unix:{path}")


@pytest.mark.parametrize("text,want", [
    ("unix:/run/s/h0.grpc", ("unix:/run/s/h0.grpc", 0)),
    ("node-3", ("node-3:8490", 8491)),
    ("node-3:9000", ("node-3:9000", 8491)),
    ("node-3:9000:9001", ("node-3:9000", 9001)),
    ("[::1]:7000:7001", ("[::1]:7000", 7001)),
], ids=["unix", "host", "host-port", "host-ports", "ipv6"])
def test_a_host_list_entry_reads_each_form_with_its_health_port(text, want):
  at, health = address_lib.parse_entry(text, port=8490, health_port=8491)
  assert (at.target, health) == want


@pytest.mark.parametrize("text,match", [
    ("/tmp/x/host0.grpc", r"entry '/tmp/x/host0.grpc' is a path, not HOST\[:PORT\[:HEALTH_PORT\]\] "
                          r"or unix:PATH: a sidecar on a Unix socket is unix:/tmp/x/host0.grpc"),
    ("node:65536", r"entry 'node:65536' has port '65536'; ports are integers in 1\.\.65535"),
    ("node:1:2:3", r"entry 'node:1:2:3' is not HOST\[:PORT\[:HEALTH_PORT\]\] or unix:PATH"),
], ids=["path", "port-over-65535", "three-ports"])
def test_a_host_list_entry_that_can_never_answer_names_the_form(text, match):
  with pytest.raises(sidecar.InvalidArgumentError, match=match):
    address_lib.parse_entry(text, port=8490, health_port=8491)


def test_a_relative_socket_path_without_unix_is_told_its_unix_spelling(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with socket.socket(socket.AF_UNIX) as s:
    s.bind("host0.grpc")  # a socket of that name here: no host name
    with pytest.raises(sidecar.InvalidArgumentError, match=r"a sidecar on a Unix socket is "
                                                           r"unix:host0.grpc"):
      address_lib.parse_entry("host0.grpc", port=8490, health_port=8491)


def test_an_ip_address_or_a_name_this_machine_resolves_is_never_refused():
  assert address_lib.unresolvable("127.0.0.1") is None
  assert address_lib.unresolvable("::1") is None
  assert address_lib.unresolvable("localhost") is None
  address_lib.check_resolvable([address_lib.parse("localhost:1"), address_lib.parse("[::1]:1"),
                                address_lib.parse("unix:/x.sock")], what="test")


def test_a_name_that_is_no_host_name_at_all_is_refused_naming_it():
  label = "x" * 64  # over 63 characters: no DNS label can be, so no lookup is made
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=rf"sidecar addresses: {label}.a:8490 \(not a host name: .*\): no such "
                           r"host name, so no sidecar can ever answer there; give HOST:PORT .*or "
                           r"unix:PATH for a sidecar on this machine"):
    address_lib.check_resolvable([address_lib.parse(f"{label}.a:8490")],
                                 what="sidecar addresses")


def test_only_a_name_that_does_not_exist_is_refused_a_dns_that_is_down_is_waited_for(
    monkeypatch):
  # What the resolver answers, without a DNS: NXDOMAIN (EAI_NONAME), or "try again".
  answers = {"gone.example": (socket.EAI_NONAME, "Name or service not known"),
             "slow.example": (socket.EAI_AGAIN, "Temporary failure in name resolution")}

  def getaddrinfo(host, *args, **kwargs):
    raise socket.gaierror(*answers[host])

  monkeypatch.setattr(address_lib.socket, "getaddrinfo", getaddrinfo)
  assert address_lib.unresolvable("gone.example") == "Name or service not known"
  assert address_lib.unresolvable("slow.example") is None  # it may yet answer: the wait holds
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"SIDECAR_HOSTS: gone.example:1 \(Name or service not known\): no "
                           r"such host name"):
    address_lib.check_resolvable([address_lib.parse("gone.example:1"),
                                  address_lib.parse("slow.example:2")], what="SIDECAR_HOSTS")
