"""Which connections of the control port are strangers (server/ports/strangers.py): the
remotes gRPC names and the socket addresses the kernel gives, as one endpoint each; the
admitted ones forgotten only once closed. The scans themselves meet real sockets in
tests/server/server/test_port_floods.py."""

import pytest

from sidecar._src.server.ports import strangers

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("remote,expected", [
    ("ipv4:127.0.0.1:50412", ("127.0.0.1", 50412)),
    ("ipv6:%5B::1%5D:44572", ("::1", 44572)),
    ("ipv6:%5B::ffff:10.0.0.7%5D:9", ("10.0.0.7", 9)),
    (("::ffff:10.0.0.7", 9, 0, 0), ("10.0.0.7", 9)),
    (("fe80::1%eth0", 80, 0, 2), ("fe80::1", 80)),
    (("10.0.0.7", 9), ("10.0.0.7", 9)),
    ("unix:", None), ("unix:/run/x.sock", None), ("ipv4:not-an-ip:5", None),
], ids=["ipv4", "ipv6", "ipv6-mapped", "socket-mapped", "socket-scoped", "socket-v4", "unix",
        "unix-path", "garbage"])
def test_a_remote_is_one_endpoint_whoever_names_it(remote, expected):
  assert strangers.endpoint(remote) == expected


def test_an_admitted_connection_is_forgotten_only_once_gone_and_seen_before_the_look():
  admitted = strangers.Admitted()
  admitted.note("ipv4:10.0.0.7:9")
  admitted.note("unix:")  # no endpoint: nothing to record
  assert admitted.admitted(("10.0.0.7", 9))
  admitted.forget(keep=set(), before=0.0)  # recorded after the look began: kept
  assert admitted.admitted(("10.0.0.7", 9))
  admitted.forget(keep={("10.0.0.7", 9)}, before=float("inf"))  # still open: kept
  assert admitted.admitted(("10.0.0.7", 9))
  admitted.forget(keep=set(), before=float("inf"))
  assert not admitted.admitted(("10.0.0.7", 9))
