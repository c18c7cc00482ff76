"""Tier 2: a call's response serialized with its large arrays written once (issue 37):
``UnaryCalls.run_serialized`` answers what ``run`` answers, byte for byte."""

import numpy as np
import pytest

from sidecar._src.server import calls as calls_lib
from sidecar._src.wire import codec, pbscan, protocol
from sidecar._src.wire.protocol import pb
from tests.support.raw_client import Raw

pytestmark = pytest.mark.server

BIG = pbscan.BIG_ARRAY


def request(name: str, *args) -> bytes:
  return pb.CallRequest(name=name, args=codec.encode(args, inline_limit=1 << 40),
                        kwargs=codec.encode({})).SerializeToString()


@pytest.mark.parametrize("args", [
    (np.arange(BIG // 4, dtype=np.int32),),
    ({"a": np.ones((2, BIG), np.uint8), "b": [np.zeros(3), "s", np.full(BIG, 2, np.int16)]},),
    (np.arange(10),),
], ids=["one-big", "nested-big", "small"])
def test_run_serialized_answers_what_run_answers(make_server, args):
  server = make_server()
  raw_client = Raw(server.port)
  try:
    session = dict(raw_client.metadata)[protocol.SESSION_KEY]
    unary = server.service._unary
    alive = lambda: True  # noqa: E731
    expected = unary.run(request("echo", *args), session, alive=alive).SerializeToString()
    got = unary.run_serialized(request("echo", *args), session, alive=alive)
    assert got == expected
    np.testing.assert_equal(codec.decode(pb.CallResponse.FromString(got).result), args[0])
    assert calls_lib.serialize(got) is got
    assert calls_lib.serialize(pb.CallResponse.FromString(got)) == got
  finally:
    raw_client.close()


def test_run_serialized_raises_what_the_call_raises(make_server):
  server = make_server()
  raw_client = Raw(server.port)
  try:
    session = dict(raw_client.metadata)[protocol.SESSION_KEY]
    with pytest.raises(ValueError, match="boom"):
      server.service._unary.run_serialized(request("fail", "boom"), session, alive=lambda: True)
  finally:
    raw_client.close()
