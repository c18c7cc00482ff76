"""Tier 1: a large message in CallParts (issue 54): cut from its pieces (a response's are
views of its result's arrays) into parts of at most PIECE_BYTES, put back together into
one buffer whose arrays the decoder views, byte for byte what one message would be."""

import numpy as np
import pytest

from sidecar._src.core import errors
from sidecar._src.wire import codec, parts, pbscan
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("sizes, piece_bytes", [
    ([10, 0, 7, 15], 8),
    ([16], 8),
    ([3], 8),
    ([], 8),
    ([0], 8),
], ids=["across-pieces", "exact", "short", "no-piece", "empty"])
def test_parts_carry_the_pieces_in_order_the_first_announcing_the_total(sizes, piece_bytes):
  pieces = [bytes(range(i * 16, i * 16 + n)) for i, n in enumerate(sizes)]
  whole = b"".join(pieces)
  raw = list(parts.cut(pieces, len(whole), piece_bytes=piece_bytes))
  got = [pb.CallPart.FromString(r) for r in raw]
  assert b"".join(p.data for p in got) == whole
  assert [len(p.data) for p in got[:-1]] == [piece_bytes] * (len(got) - 1)
  assert 0 < len(got) == max(1, -(-len(whole) // piece_bytes))
  assert [p.total for p in got] == [len(whole)] + [0] * (len(got) - 1)
  assert raw == [p.SerializeToString() for p in got]  # as protobuf writes them
  assert parts.assemble(len(whole), raw) == whole


def test_a_response_cut_from_its_arrays_decodes_to_views_of_the_one_buffer():
  """The pieces ``splice_pieces`` makes (the result's arrays' own bytes) cut and put back
  together: its arrays are writable views of the buffer, equal to what was sent."""
  a, b = np.arange(3 * pbscan.BIG_ARRAY, dtype=np.uint8), np.full(pbscan.BIG_ARRAY, 7, np.int16)
  arrays: list[np.ndarray] = []

  def set_aside(x):
    arrays.append(x)
    return codec.ArenaRef(len(arrays) - 1, x.nbytes, 0, x.dtype.name, x.shape)

  result = codec.encode({"a": a, "rest": [b, "s"]}, to_arena=set_aside,
                        inline_limit=pbscan.BIG_ARRAY)
  pieces, size = pbscan.splice_pieces(pb.CallResponse(result=result).SerializeToString(),
                                      pb.CallResponse.DESCRIPTOR, arrays)
  assert any(isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), a)
             for p in pieces)  # a's bytes, not a copy
  whole = parts.assemble(size, parts.cut(pieces, size))
  assert bytes(whole) == pb.CallResponse(result=codec.encode(
      {"a": a, "rest": [b, "s"]}, inline_limit=1 << 40)).SerializeToString()
  stripped, views = pbscan.strip_arrays(whole, pb.CallResponse.DESCRIPTOR)
  out = codec.decode(pb.CallResponse.FromString(stripped).result, views=views)
  np.testing.assert_array_equal(out["a"], a)
  np.testing.assert_array_equal(out["rest"][0], b)
  assert out["rest"][1] == "s"
  for x in (out["a"], out["rest"][0]):
    assert x.flags.writeable and np.shares_memory(x, np.frombuffer(whole, np.uint8))


@pytest.mark.parametrize("total, match", [
    (5, "CallPart 1 brings the response past the 5 bytes its first part announced"),
    (20, "the response's pieces ended after 12 of the 20 bytes"),
], ids=["more", "fewer"])
def test_parts_that_do_not_add_up_are_invalid(total, match):
  raw = list(parts.cut([b"x" * 12], 12, piece_bytes=4))
  with pytest.raises(errors.InvalidArgumentError, match=match):
    parts.assemble(total, raw, what="the response")
