"""Tier 1: a plain iterable's batches are written element by element into their blocks."""

import numpy as np
import pytest

import sidecar
from sidecar._src.host.feeds import producer as feed
from sidecar._src.user import registry as registry_lib

pytestmark = pytest.mark.unit


def run(elements, *, ranges=((0, 2), (3, 5)), epochs=1):
  """Batches of ``elements`` from a plain pipeline, with numpy arrays as the arena."""
  allocs = []

  def alloc(shape, dtype):
    allocs.append(shape)
    return np.full(shape, -1, dtype)

  def pipeline(ctx):
    return iter(elements)
  spec = feed.Spec(global_batch_size=5, ranges=ranges, seed=0, num_epochs=epochs, shard_index=0,
                   shard_count=1, start={}, workers=0)
  entry = registry_lib.Entry(kind=registry_lib.PIPELINE, name="p", fn=pipeline, code_hash="",
                             signature=None)
  out = [tree for tree, _, _ in feed.produce(entry, {}, spec, alloc)]
  return out, allocs


def test_rows_land_in_their_ranges():
  out, _ = run([{"x": np.int32(i), "v": np.full(2, i, np.float32)} for i in range(8)])
  assert len(out) == 2
  np.testing.assert_array_equal(out[0]["x"][0], [0, 1])
  np.testing.assert_array_equal(out[0]["x"][1], [2, 3])
  np.testing.assert_array_equal(out[1]["v"][1], [[6, 6], [7, 7]])


def test_the_blocks_of_an_epochs_partial_batch_serve_the_next_batch():
  out, allocs = run([{"x": np.int32(i)} for i in range(6)], epochs=2)  # 4 + 2 an epoch
  assert len(out) == 2 and len(allocs) == 3 * 2  # not 4 x 2: epoch 1's batch reused blocks
  np.testing.assert_array_equal(out[1]["x"][1], [2, 3])
  with pytest.raises(sidecar.InvalidArgumentError, match="fewer than the 4 elements"):
    run([{"x": np.int32(0)}])


@pytest.mark.parametrize("second,match", [
    ({"x": np.zeros(3, np.int32)}, r"element leaf \['x'\] has shape \(3,\), but the first .* \(\)"),
    ({"x": np.int32(1), "y": 2}, "yielded an element of structure"),
    ({"x": np.complex64(1j)}, "cannot write leaf 0 of dtype complex64 into the batch's int32"),
], ids=["shape", "structure", "dtype"])
def test_an_element_unlike_the_first_is_invalid_argument(second, match):
  with pytest.raises(sidecar.InvalidArgumentError, match=match):
    run([{"x": np.int32(0)}, second, {"x": np.int32(2)}, {"x": np.int32(3)}])


def test_a_map_datasets_element_of_another_dtype_is_invalid_argument():
  spec = feed.Spec(global_batch_size=2, ranges=((0, 2),), seed=0, num_epochs=1, shard_index=0,
                   shard_count=1, start={}, workers=0)
  batcher = feed.Batcher(spec, lambda shape, dtype: np.zeros(shape, dtype), "p")
  batcher.learn({"x": np.int32(0)})
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"cannot batch leaf 0 of dtypes \['complex64', 'int32'\] as the "
                           r"first element's int32"):
    batcher.write(None, [{"x": np.int32(0)}, {"x": np.complex64(1j)}])
