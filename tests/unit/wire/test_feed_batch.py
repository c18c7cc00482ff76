"""A feed batch's message: the arrays the feed placed as descriptors, any other as a value."""

import numpy as np
import pytest

from sidecar._src.wire import codec, feed_batch

pytestmark = pytest.mark.unit


def test_placed_arrays_travel_as_descriptors_and_any_other_is_checked_and_inline():
  placed = np.full((4, 3), 2.5, np.float32)
  big_endian = np.arange(6, dtype=">i4").reshape(2, 3)  # not the feed's: made native
  empty = np.zeros((0, 3), np.uint8)  # zero bytes: never a descriptor
  refs = {id(placed): codec.ArenaRef(8192, placed.nbytes, 5, "float32", (4, 3)),
          id(empty): codec.ArenaRef(0, 1, 1, "uint8", (0, 3))}
  structure = codec.encode({"x": 0, "y": [1, 2]})
  batch = feed_batch.encode(structure, [[placed], [big_endian], [empty]], {"position": 4}, 0.5,
                            to_arena=lambda a: refs.get(id(a)), where="batch 0")
  parts = [leaf.parts[0] for leaf in batch.leaves]
  assert [p.WhichOneof("kind") for p in parts] == ["arena", "array", "array"]
  assert parts[0] == codec.arena_value(refs[id(placed)])
  views = {8192: placed}
  out = feed_batch.decode(batch, from_arena=lambda ref: views[ref.offset], where="batch 0")
  assert out.leaves[0][0] is placed and out.state == {"position": 4}
  np.testing.assert_array_equal(out.leaves[1][0], big_endian)
  assert out.leaves[1][0].dtype == np.dtype("int32") and out.leaves[2][0].shape == (0, 3)
  assert feed_batch.fill(out.structure, [1, 2, 3]) == {"x": 1, "y": [2, 3]}
