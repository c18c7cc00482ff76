"""What a tenant process sends is read as a client's request (server/tenant_procs/messages.py):
only the kinds expected, every field checked, raw bytes bounded before any is read.

Tier 1: socketpairs, no server.
"""

import json
import socket
import struct

import pytest

from sidecar._src.core import errors
from sidecar._src.server.tenant_procs import messages as m

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
  a, b = socket.socketpair()
  with a, b:
    yield a, b


def _raw(sock, d):
  data = json.dumps(d).encode()
  sock.sendall(struct.pack("<I", len(data)) + data)


def test_a_message_and_its_bytes_cross_as_they_were(pair):
  a, b = pair
  m.send(a, m.Batch(3, ((0, 4096), (8192,)), {"epoch": 1}, 0.5), b"abc")
  got, payload, fds = m.recv(b, (m.Batch,), payload_limit=3, what="tenant 'bob''s process")
  assert got == m.Batch(3, ((0, 4096), (8192,)), {"epoch": 1}, 0.5)
  assert payload == b"abc" and fds == []


def test_every_kind_round_trips_through_its_dict():
  for cls in m.BY_KIND.values():
    sample = {name: _sample(check) for name, check in cls.FIELDS.items()}
    message = cls.from_dict(sample)
    assert cls.from_dict(json.loads(json.dumps(message.to_dict()))) == message


def _sample(check):
  for value in (0, True, "x", [], {}, 1.5, None, "result"):
    try:
      check(value)
      return value
    except (TypeError, ValueError):
      continue
  raise AssertionError(check)


@pytest.mark.parametrize("sent, match", [
    ({"kind": "response"}, r"a response message has no 'nbytes'"),
    ({"kind": "response", "nbytes": -1}, r"'nbytes' is not an int in \[0, 2\^63\)"),
    ({"kind": "response", "nbytes": True}, r"'nbytes' is not an int"),
    ({"kind": "response", "nbytes": 1 << 40}, r"more than a message carries"),
    ({"kind": "batch", "nbytes": 0, "leaves": [[1]] * 9000, "state": {}, "seconds": 0},
     r"'leaves' is not a list of at most 8192 leaves"),
    ({"kind": "batch", "nbytes": 0, "leaves": [["x"]], "state": {}, "seconds": 0},
     r"'leaves' is not an int"),
    ({"kind": "batch", "nbytes": 0, "leaves": [], "state": [], "seconds": 0},
     r"'state' is not an object"),
    ({"kind": "alloc", "nbytes": 8, "use": "anything", "shape": [], "dtype": ""},
     r"'use' is not one of"),
    ({"kind": "hello"},
     r"sent a message of kind 'hello', where one of \['response', 'batch', 'alloc'\]"),
    ({"kind": "pickle"}, r"sent a message of kind 'pickle'"),
    ({"nbytes": 1}, r"sent a message of kind None"),
], ids=["missing", "negative", "bool", "too-large", "too-many-leaves", "a-str-offset",
        "state-not-object", "unknown-use", "unexpected-kind", "unknown-kind", "no-kind"])
def test_a_malformed_or_unexpected_message_is_refused_naming_its_sender(pair, sent, match):
  a, b = pair
  _raw(a, sent)
  with pytest.raises(errors.InvalidArgumentError, match=match):
    m.recv(b, (m.Response, m.Batch, m.Alloc), payload_limit=1 << 20,
           what="tenant 'bob''s process")


def test_bytes_past_the_bound_are_refused_before_any_is_read(pair):
  a, b = pair
  _raw(a, {"kind": "response", "nbytes": 1 << 30})  # and none follow
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"tenant 'bob''s process answered with a response of 1073741824 "
                     r"bytes, more than the 1024 it may"):
    m.recv(b, (m.Response,), payload_limit=1024, what="tenant 'bob''s process")


def test_a_socket_that_ends_mid_message_is_a_connection_error(pair):
  a, b = pair
  m.send(a, m.Response(10), b"short")
  a.close()
  with pytest.raises(ConnectionError):
    m.recv(b, (m.Response,), payload_limit=10, what="tenant 'bob''s process")
