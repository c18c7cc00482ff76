import pytest

from sidecar._src.core import options as options_lib
from sidecar._src.core.options import ServerOptions

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kwargs,match", [
    ({"host_id": -1}, "host_id must be a non-negative int, got -1"),
    ({"port": 70000}, r"port \(--port\) must be a TCP port in 1..65535.*got 70000"),
    ({"port": 9000, "health_port": 9000}, "port and health_port must differ"),
    ({"shm_size": 10}, "shm_size must be at least 1048576 bytes, got 10"),
    ({"device_ids": (0, -2)}, "device_ids must be non-negative"),
    ({"socket_path": ""}, "socket_path must name"),
    ({"token": "  "}, "token holds ' ' at position 0: a token must be visible ASCII"),
    ({"checkpoint_roots": "/ckpt"}, r"checkpoint_roots must be a tuple .*--checkpoint-root"),
    ({"checkpoint_roots": ("/ckpt", "")}, "checkpoint_roots must be a tuple of directory paths"),
    ({"feed_idle_s": -1.0}, r"feed_idle_s \(--feed-idle-s\) must be finite seconds >= 0 "
                            r"\(0: a feed's workers stop with it\), got -1.0"),
    ({"feed_idle_s": float("inf")}, r"feed_idle_s \(--feed-idle-s\) must be finite"),
], ids=["host", "port", "same-port", "shm", "devices", "socket", "token", "roots-str",
        "roots-empty", "feed-idle-negative", "feed-idle-forever"])
def test_bad_options_name_the_value(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ServerOptions(**kwargs)


@pytest.mark.parametrize("kwargs,flag", [
    ({"port": 70000}, "--port"), ({"port": 65536}, "--port"),
    ({"health_port": -1}, "--health-port"),
    ({"metrics_port": 99999}, "--metrics-port"), ({"metrics_port": -1}, "--metrics-port"),
    ({"port": True}, "--port"),
], ids=["port-70000", "port-65536", "health-minus-1", "metrics-99999", "metrics-minus-1",
        "port-bool"])
def test_a_port_outside_the_range_names_its_flag_value_and_range(kwargs, flag):
  # gRPC would bind 70000 as 4464 and -1 as 65535, and name that port in its error.
  (name, value), = kwargs.items()
  with pytest.raises(ValueError, match=rf"^{name} \({flag}\) must be a TCP port in 1\.\.65535, "
                     rf"or 0 to pick a free one.*; got {value!r}$"):
    ServerOptions(**kwargs)


@pytest.mark.parametrize("kwargs", [{"port": 0, "health_port": 0}, {"metrics_port": 0},
                                    {"metrics_port": None}, {"port": 65535, "health_port": 1}],
                         ids=["free-ports", "free-metrics", "no-metrics", "ends"])
def test_ports_zero_and_the_ends_of_the_range_are_taken(kwargs):
  ServerOptions(**kwargs)


def test_options_are_frozen():
  o = ServerOptions()
  with pytest.raises(AttributeError):
    o.port = 1  # type: ignore[misc]


def test_the_default_listens_on_loopback_only():
  assert options_lib.is_loopback(ServerOptions().listen)


@pytest.mark.parametrize("listen", ["0.0.0.0", "[::]", "::", "10.1.2.3", "[fe80::1]", "example.com",
                                    "sidecar-0.svc"])
def test_a_non_loopback_listen_needs_a_token_or_insecure(listen):
  assert not options_lib.is_loopback(listen)
  with pytest.raises(ValueError, match=r"not a loopback address and no token.*--token-file.*"
                                       r"--insecure"):
    ServerOptions(listen=listen)
  assert ServerOptions(listen=listen, token="s3cret").listen == listen
  assert ServerOptions(listen=listen, insecure=True).insecure


@pytest.mark.parametrize("listen", ["127.0.0.1", "127.8.9.10", "localhost", "LocalHost", "[::1]",
                                    "::1"])
def test_loopback_addresses_need_no_token(listen):
  assert options_lib.is_loopback(listen)
  assert ServerOptions(listen=listen).token is None


def test_a_unix_listen_needs_no_token_and_no_port():
  o = ServerOptions(listen="unix:/run/sidecar/grpc.sock", port=0, health_port=0)
  assert options_lib.is_loopback(o.listen) and o.token is None
  assert o.unix is not None and o.unix.target == "unix:/run/sidecar/grpc.sock"
  assert ServerOptions().unix is None
  assert ServerOptions(listen="unix:///run/g.sock", socket_group="trainers").socket_group


@pytest.mark.parametrize("kwargs,match", [
    ({"listen": "unix:/run/sidecar/sidecar.sock"},
     r"is the worker socket \(socket_path\); the gRPC server needs a socket of its own"),
    ({"listen": "unix:/run/g.sock", "tls_cert": "c.pem", "tls_key": "k.pem"},
     r"TLS \(--tls-cert\) is for TCP; listen 'unix:/run/g.sock' is a Unix socket"),
    ({"listen": "127.0.0.1", "socket_group": "trainers"},
     r"socket_group \(--socket-group\) applies to a unix: listen address"),
    ({"listen": "unix:/run/g.sock", "socket_group": " "}, "socket_group must be a group name"),
    ({"listen": "unix:/" + "x" * 120},
     r"its path is 121 bytes, a Unix socket's may be at most 107"),
], ids=["worker-socket", "tls", "group-on-tcp", "empty-group", "too-long"])
def test_bad_unix_listen_options_name_the_value_and_the_fix(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ServerOptions(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"prefetch": 0}, "prefetch must be a positive int, got 0"),
    ({"prefetch": True}, "prefetch must be a positive int, got True"),
    ({"workers": -1}, r"workers must be an int >= 0 \(0: the sidecar itself\), got -1"),
    ({"workers": 1.5}, "workers must be an int >= 0"),
    ({"device_prefetch": -1}, r"device_prefetch must be None \(the framework's choice\) or an "
                              r"int >= 0, got -1"),
    ({"device_prefetch": False}, r"device_prefetch must be None .* got False"),
], ids=["prefetch-zero", "prefetch-bool", "workers-negative", "workers-float",
        "device-prefetch-negative", "device-prefetch-bool"])
def test_bad_feed_options_name_the_value(kwargs, match):
  with pytest.raises(ValueError, match=match):
    options_lib.FeedOptions(**kwargs)


def test_feed_options_are_frozen_keyword_only_values():
  o = options_lib.FeedOptions(workers=2)
  assert (o.prefetch, o.workers) == (2, 2) and o == options_lib.FeedOptions(workers=2, prefetch=2)
  with pytest.raises(AttributeError):
    o.workers = 3  # type: ignore[misc]
  with pytest.raises(TypeError):
    options_lib.FeedOptions(4)  # type: ignore[misc]


@pytest.mark.parametrize("token", [
    "0123abcd\n", "0123abcd\r\n"], ids=["newline", "crlf"])
def test_a_token_ending_in_a_newline_says_to_strip_it_or_name_the_file(token):
  # Issue 55 item 7: `openssl rand -hex 32 > FILE` writes a newline; the hint said to write
  # the file that way, and `open(FILE).read()` of it kept the newline it complained about.
  with pytest.raises(ValueError, match=r"^token ends in '(\\r)?\\n' after 8 characters, as a "
                     r"token file's text does: pass the text stripped \(`open\(FILE\)\.read\(\)"
                     r"\.strip\(\)`\), or name the file \(SIDECAR_TOKEN_FILE=FILE"):
    options_lib.check_token(token)


def test_a_token_file_with_the_newline_every_tool_writes_is_read_without_it(tmp_path):
  from sidecar._src.core import env as env_lib, rendezvous
  path = tmp_path / "token"
  path.write_text("0123abcd\n")  # what `openssl rand -hex 32 > FILE` writes
  path.chmod(0o600)
  assert env_lib.token(str(path), environ={}) == "0123abcd"
  assert rendezvous.read_token_file(str(path)) == "0123abcd"
  options_lib.check_token(env_lib.token(str(path), environ={}))
