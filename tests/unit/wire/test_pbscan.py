"""Tier 1: the wire scanner's splice of a response's large arrays (issue 37): the bytes it
writes are those protobuf would have serialized, each array's bytes copied once."""

import numpy as np
import pytest

from sidecar._src.wire import codec, pbscan
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit

BIG = pbscan.BIG_ARRAY


def set_aside(tree):
  """``tree`` encoded with its large arrays as placeholders, and those arrays."""
  arrays = []

  def to_list(a):
    arrays.append(a)
    return codec.ArenaRef(len(arrays) - 1, a.nbytes, 0, a.dtype.name, a.shape)

  return codec.encode(tree, to_arena=to_list, inline_limit=BIG), arrays


TREES = [
    np.arange(BIG // 4, dtype=np.int32),
    {"w": np.ones((3, BIG // 4), np.float16), "n": 3, "s": "x", "small": np.arange(5)},
    [1, (np.full(BIG + 7, 9, np.uint8), None), {"deep": [[np.zeros((2, 2, BIG // 4))]]}],
    (np.arange(2 * BIG, dtype=np.uint8).reshape(4, -1)[:, ::2],),  # not contiguous: encoded as C
]


@pytest.mark.parametrize("tree", TREES, ids=["one", "dict", "nested", "strided"])
def test_spliced_bytes_are_what_protobuf_serializes_inline(tree):
  value, arrays = set_aside(tree)
  assert arrays, "the tree holds a large array"
  placeheld = pb.CallResponse(result=value).SerializeToString()
  assert len(placeheld) < 4096  # the message protobuf copies holds no array's bytes
  spliced = pbscan.splice_arrays(placeheld, pb.CallResponse.DESCRIPTOR, arrays)
  assert spliced == pb.CallResponse(result=codec.encode(tree)).SerializeToString()
  decoded = codec.decode(pb.CallResponse.FromString(spliced).result)
  np.testing.assert_equal(decoded, tree)


def test_nothing_set_aside_returns_the_bytes_as_they_are():
  raw = pb.CallResponse(result=codec.encode([1, 2])).SerializeToString()
  assert pbscan.splice_arrays(raw, pb.CallResponse.DESCRIPTOR, []) is raw


def test_an_array_without_its_placeholder_or_a_placeholder_without_its_array_is_an_error():
  value, arrays = set_aside([np.ones(BIG, np.uint8), np.ones(BIG, np.uint8)])
  raw = pb.CallResponse(result=value).SerializeToString()
  with pytest.raises(ValueError, match="1 of 3 arrays had no placeholder in the message"):
    pbscan.splice_arrays(raw, pb.CallResponse.DESCRIPTOR, [*arrays, arrays[0]])
  a = np.ones(BIG, np.uint8)
  stray = codec.encode(a, to_arena=lambda a: codec.ArenaRef(1, a.nbytes, 0, "uint8", a.shape))
  with pytest.raises(IndexError):
    pbscan.splice_arrays(pb.CallResponse(result=stray).SerializeToString(),
                         pb.CallResponse.DESCRIPTOR, [a])
