"""Tier 2: floods of the control and health ports by anyone who reaches them, without a
token (issue 76, attack round eight): raw HTTP/2 from another loopback peer
(``h2_flood.STRANGER``), while a client with the token (alice, on 127.0.0.1) connects anew.

The bounds are made small here (a few connections show what 2,048 did);
``tests/processes/server/test_port_floods.py`` holds the issue's own numbers against a
``sidecar serve`` with its defaults.
"""

import grpc
import pytest

import sidecar
from sidecar._src.wire import protocol
from tests.support import h2_flood

pytestmark = pytest.mark.server
TOKEN = "alice-token-0123456789abcdef"


def alice_connects(server, timeout: float = 10.0) -> list:
  """A new Controller of alice's (a new channel, a new connection): its handshake and one
  call, within ``timeout`` s."""
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token=TOKEN, timeout=timeout,
                              connect_timeout=timeout) as ctl:
    return ctl.call("add", args=(2,), kwargs={"b": 3})


def test_calls_without_a_token_whose_request_never_comes_hold_no_thread(make_server):
  """Before: 64 half-open calls on one connection held every server thread (19 here: 2
  threads, 1 stream, 16 checkpoint), and no client could handshake."""
  server = make_server(token=TOKEN, threads=2, max_streams=1)
  sock = h2_flood.connect(server.port)
  try:
    h2_flood.half_open(sock, f"/{protocol.SERVICE}/Status", 64)
    h2_flood.half_open(sock, f"/{protocol.SERVICE}/Call", 32, first=129,
                       metadata=((protocol.AUTH_KEY, "Bearer wrong"),))
    assert alice_connects(server, timeout=5) == [5]
  finally:
    h2_flood.close([sock])


def test_a_refused_call_says_why_having_read_nothing(make_server):
  server = make_server(token=TOKEN)
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
    status = channel.unary_unary(f"/{protocol.SERVICE}/Status")
    with pytest.raises(grpc.RpcError) as info:
      status(b"", timeout=5)
  assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
  assert "missing or wrong token" in info.value.details()
