"""Tier 2: a call's response serialized with its large arrays written once (issue 37):
``UnaryCalls.run_serialized`` answers what ``run`` answers, byte for byte; a large call in
parts (CallParts, issue 42) answers what it answers as one message, in parts (issue 54)."""

import re
import time

import grpc
import numpy as np
import pytest

import sidecar
from sidecar._src.controller import calls as controller_calls
from sidecar._src.server.calls import calls as calls_lib
from sidecar._src.wire import codec, parts as wire_parts, pbscan, protocol
from sidecar._src.wire.protocol import pb
from tests.support.pool_files import BOB, POOL, write_pool
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


# ---- CallParts: a large call in parts (issue 42: 128 MiB inline cost 3x its size) ----------


def call_parts(raw_client: Raw, parts, *, timeout: float = 30) -> pb.CallResponse:
  """CallParts: ``parts`` sent; the response's parts put together and parsed."""
  answer = list(parts_rpc(raw_client)(iter(parts), metadata=raw_client.metadata,
                                      timeout=timeout))
  return pb.CallResponse.FromString(
      wire_parts.assemble(pb.CallPart.FromString(answer[0]).total, answer))


def parts_rpc(raw_client: Raw) -> grpc.StreamStreamMultiCallable:
  """CallParts, its parts sent as CallPart messages and received as bytes."""
  return raw_client.channel.stream_stream(
      f"/{protocol.SERVICE}/CallParts", request_serializer=pb.CallPart.SerializeToString)


def in_parts(raw: bytes, size: int, total: int | None = None) -> list[pb.CallPart]:
  return [pb.CallPart(total=(len(raw) if total is None else total) if o == 0 else 0,
                      data=raw[o:o + size]) for o in range(0, len(raw), size)]


def test_a_call_in_parts_answers_what_the_call_answers_its_arrays_writable(make_server):
  server = make_server()
  raw_client = Raw(server.port)
  try:
    a = np.arange(3 * BIG // 4, dtype=np.float32) + 0.5  # past BIG_ARRAY: viewed, not copied
    for name in ("echo", "stats"):
      raw = request(name, a)
      got = call_parts(raw_client, in_parts(raw, 100_003))  # parts of any size
      assert got == pb.CallResponse.FromString(
          server.service._unary.run_serialized(raw, dict(raw_client.metadata)[
              protocol.SESSION_KEY], alive=lambda: True))
    assert codec.decode(got.result)["writeable"]  # a view of the call's own buffer
    np.testing.assert_array_equal(codec.decode(call_parts(raw_client, in_parts(
        request("echo", a), 1 << 20)).result), a)
  finally:
    raw_client.close()


def test_a_large_response_comes_back_in_parts_cut_from_its_result(make_server):
  """echo of 3 MiB: its response in pieces of at most PIECE_BYTES of data, the first
  announcing the whole, put together into what one message of it would have been."""
  server = make_server()
  raw_client = Raw(server.port)
  try:
    a = np.arange(3 << 20, dtype=np.uint8)
    raw = request("echo", a)
    answer = list(parts_rpc(raw_client)(iter(in_parts(raw, 1 << 20)),
                                        metadata=raw_client.metadata, timeout=30))
    parts = [pb.CallPart.FromString(p) for p in answer]
    one = server.service._unary.run_serialized(raw, dict(raw_client.metadata)[
        protocol.SESSION_KEY], alive=lambda: True)
    assert [p.total for p in parts] == [len(one)] + [0] * (len(parts) - 1)
    assert [len(p.data) for p in parts] == [wire_parts.PIECE_BYTES] * 3 + [len(one) - (3 << 20)]
    assert b"".join(p.data for p in parts) == one
  finally:
    raw_client.close()


def test_a_large_calls_error_arrives_as_the_documented_one(make_server):
  """A call in parts that raises answers no part: its error, as a one-message call's."""
  with sidecar.jax.Controller([f"127.0.0.1:{make_server(host_id=2).port}"], timeout=30,
                              attach=False) as ctl:
    with pytest.raises(sidecar.RemoteError) as info:
      ctl.call("fail", args=("boom" + "x" * controller_calls.PIECES_FROM,))
    assert info.value.remote_type == "builtins.ValueError" and info.value.host_id == 2
    assert info.value.remote_message.startswith("boomxxx")
    (future,) = ctl.call_async("add", args=(np.ones(controller_calls.PIECES_FROM), "s"))
    with pytest.raises(sidecar.RemoteError, match="UFuncNoLoopError|ufunc"):
      future.result(30)


@pytest.mark.parametrize("how", ["stops-reading", "cancels"])
def test_a_caller_that_stops_reading_its_parts_holds_the_sidecar_until_it_leaves(
    make_server, how):
  """A response in parts that nobody reads: gRPC's flow control stops the sending, and the
  call's slot and inline bytes stay held (they count against the caller), until its
  deadline passes or it cancels; then both go back, with the result."""
  server = make_server()
  raw_client = Raw(server.port)
  unary = server.service._unary
  try:
    raw = request("echo", np.ones(64 << 20, np.uint8))
    responses = parts_rpc(raw_client)(iter(in_parts(raw, 1 << 20)),
                                      metadata=raw_client.metadata, timeout=4)
    next(responses)  # the call ran; its answer is on its way
    time.sleep(1)
    assert unary.slots.running == 1 and unary._inline._held == len(raw)  # flow control
    if how == "cancels":
      responses.cancel()
    deadline = time.monotonic() + 30
    while (unary.slots.running or unary._inline._held) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert (unary.slots.running, unary._inline._held) == (0, 0)
    with pytest.raises(grpc.RpcError) as info:
      list(responses)
    assert info.value.code() == (grpc.StatusCode.CANCELLED if how == "cancels"
                                 else grpc.StatusCode.DEADLINE_EXCEEDED)
  finally:
    raw_client.close()


@pytest.mark.parametrize("total, match", [
    (10, "brings the call past the 10 bytes its first part announced"),
    (1 << 24, "ended after 4194[0-9]+ of the 16777216 bytes"),
], ids=["more", "fewer"])
def test_call_parts_that_do_not_add_up_are_invalid(make_server, total, match):
  server = make_server()
  raw_client = Raw(server.port)
  try:
    raw = request("size_of", np.ones(4 << 20, np.uint8))
    with pytest.raises(grpc.RpcError) as info:
      call_parts(raw_client, in_parts(raw, 1 << 20, total))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert re.search(match, info.value.details()), info.value.details()
  finally:
    raw_client.close()


def test_call_parts_past_max_message_size_or_inline_bytes_are_refused_unread(make_server,
                                                                              tmp_path):
  server = make_server(max_message_size=8 << 20)
  raw_client = Raw(server.port)
  try:
    with pytest.raises(grpc.RpcError) as info:  # announced: refused before any is kept
      call_parts(raw_client, [pb.CallPart(total=1 << 40, data=b"x")])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "(max_message_size=8388608)" in info.value.details()
  finally:
    raw_client.close()
  pool = POOL.replace("    functions: [add, echo, slow_count]\n",
                      "    functions: [add, echo, slow_count, size_of]\n    inline_bytes: 1MiB\n")
  pooled = make_server(pool=write_pool(tmp_path, pool))
  bob = Raw(pooled.port, token=BOB)
  try:
    raw = request("size_of", np.ones(2 << 20, np.uint8))
    with pytest.raises(grpc.RpcError) as info:
      call_parts(bob, in_parts(raw, 1 << 20))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'bob' sent an inline request of" in info.value.details()
  finally:
    bob.close()


def test_a_controllers_large_call_goes_in_parts_sync_and_async(make_server):
  """A request of calls.PIECES_FROM bytes or more goes as CallParts, a call_async too; a
  small one as one Call. The result that comes back in parts views the buffer they came
  into."""
  server = make_server()
  big = np.arange(controller_calls.PIECES_FROM // 4 + 3, dtype=np.float32)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=30, attach=False) as ctl:
    conn = ctl._sidecars.conns[0]
    assert controller_calls.call_rpc(conn, pb.CallRequest(name="x")) is conn.call_rpc
    large = pb.CallRequest(name="echo", args=codec.encode((big,), inline_limit=1 << 40))
    assert controller_calls.call_rpc(conn, large) is not conn.call_rpc  # CallParts
    (out,) = ctl.call("echo", args=(big,))
    np.testing.assert_array_equal(out, big)
    base = out
    while isinstance(base, np.ndarray):
      base = base.base
    # A view of the one buffer its response's parts came into: no copy of it was made.
    assert isinstance(base, memoryview) and isinstance(base.obj, bytearray)
    assert out.flags.writeable
    (future,) = ctl.call_async("stats", args=(big,))
    assert future.result(30) == {"sum": float(big.astype(np.float64).sum()),
                                 "shape": list(big.shape), "dtype": "float32",
                                 "writeable": True}
