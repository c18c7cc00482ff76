"""Tier 1: a plain iterable's batches are written element by element into their blocks."""

import dataclasses
from typing import NamedTuple

import jax
import numpy as np
import pytest

import sidecar
from sidecar._src.server.feeds import processes, producer
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire import codec, feed_batch

pytestmark = pytest.mark.unit


def run(elements, *, ranges=((0, 2), (3, 5)), epochs=1):
  """Batches of ``elements`` from a plain pipeline, with numpy arrays as the arena."""
  allocs = []

  def alloc(shape, dtype):
    allocs.append(shape)
    return np.full(shape, -1, dtype)

  def pipeline(ctx):
    return iter(elements)
  spec = producer.Spec(global_batch_size=5, ranges=ranges, seed=0, num_epochs=epochs, shard_index=0,
                   shard_count=1, start={}, workers=0)
  entry = registry_lib.Entry(kind=registry_lib.PIPELINE, name="p", fn=pipeline, code_hash="",
                             signature=None)
  out = [as_tree(batch) for batch, _, _ in producer.produce(entry, {}, spec, alloc)]
  return out, allocs


def as_tree(batch):
  """The element's structure with each leaf its list of per-range arrays."""
  return feed_batch.fill(codec.decode(batch.structure), batch.leaves)


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
  spec = producer.Spec(global_batch_size=2, ranges=((0, 2),), seed=0, num_epochs=1, shard_index=0,
                   shard_count=1, start={}, workers=0)
  batcher = producer.Batcher(spec, lambda shape, dtype: np.zeros(shape, dtype), "p")
  batcher.learn({"x": np.int32(0)})
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"cannot batch leaf 0 of dtypes \['complex64', 'int32'\] as the "
                           r"first element's int32"):
    batcher.write(None, [{"x": np.int32(0)}, {"x": np.complex64(1j)}])


class Pair(NamedTuple):
  a: np.ndarray
  b: list


def test_elements_holding_lists_tuples_and_namedtuples_keep_them_apart_from_the_ranges():
  elements = [{"x": [np.full((4,), i), np.full((2,), -i)], "y": np.int32(i),
               "t": (np.int64(i), Pair(np.int8(i), [None, np.float32(i)]))} for i in range(8)]
  out, _ = run(elements)
  assert len(out) == 2
  first = out[0]
  assert isinstance(first["x"], list) and len(first["x"]) == 2  # the element's list
  np.testing.assert_array_equal(first["x"][0][1], [[2, 2, 2, 2], [3, 3, 3, 3]])  # range 1
  np.testing.assert_array_equal(first["x"][1][0], [[0, 0], [-1, -1]])
  assert type(first["t"]) is tuple and type(first["t"][1]) is Pair
  assert first["t"][1].b[0] is None
  np.testing.assert_array_equal(first["t"][1].b[1][1], [2, 3])


def test_a_container_the_codec_cannot_carry_is_invalid_argument_naming_its_path():
  @dataclasses.dataclass
  class Box:
    v: np.ndarray
  jax.tree_util.register_dataclass(Box, data_fields=["v"], meta_fields=[])
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"pipeline 'p': element\['x'\]\[1\]: values of type .*Box cannot"):
    run([{"x": [np.int32(i), Box(np.zeros(2))]} for i in range(8)])
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"pipeline 'p': element\['x'\]\[0\].*dtype"):
    run([{"x": [object()]} for i in range(8)])


def test_the_check_is_told_each_blocks_bytes_before_any_block_is_allocated():
  # Issue 55 item 5: a batch whose blocks can never fit together is refused before any is.
  told, allocs = [], []

  def check(sizes):
    told.append(sizes)
    raise sidecar.ResourceExhaustedError("never fits")

  def pipeline(ctx):
    return iter([{"x": np.zeros(3, np.float32), "id": np.int64(i)} for i in range(8)])
  spec = producer.Spec(global_batch_size=5, ranges=((0, 2), (3, 5)), seed=0, num_epochs=1,
                       shard_index=0, shard_count=1, start={}, workers=0)
  entry = registry_lib.Entry(kind=registry_lib.PIPELINE, name="p", fn=pipeline, code_hash="",
                             signature=None)
  alloc = lambda shape, dtype: allocs.append(shape) or np.zeros(shape, dtype)
  with pytest.raises(sidecar.ResourceExhaustedError, match="never fits"):
    next(producer.produce(entry, {}, spec, alloc, check=check))
  assert told == [[2 * 8, 2 * 8, 2 * 12, 2 * 12]] and allocs == []  # id, x; each range


def _entry(identity):
  def pipeline(ctx, *, path):
    return iter([{"x": np.int64(i)} for i in range(10)])
  return registry_lib.Entry(kind=registry_lib.PIPELINE, name="p", fn=pipeline, code_hash="",
                            signature=None, identity=identity)


def _states(entry, start):
  spec = producer.Spec(global_batch_size=5, ranges=((0, 5),), seed=0, num_epochs=1,
                       shard_index=0, shard_count=1, start=start, workers=0)
  return [state for _, state, _ in producer.produce(entry, {"path": "/d"}, spec,
                                                     lambda shape, dtype: np.empty(shape, dtype))]


def test_a_pipeline_that_names_its_data_has_it_in_every_state_and_refuses_other_data():
  seen = []
  entry = _entry(lambda ctx, *, path: seen.append((str(ctx.data_path(path)), path))
                 or f"files of {path} v2")
  assert [s["data"] for s in _states(entry, {})] == ["files of /d v2"] * 2
  assert seen == [("/d", "/d")]  # called as the pipeline is (context, kwargs), once
  resumed = _states(entry, {"kind": "iter", "position": 5, "data": "files of /d v2"})
  assert resumed and all(s["data"] == "files of /d v2" for s in resumed)  # the same data
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"feed 'p': the state it resumes from was made from 'files of /d "
                           r"v1', but with kwargs \['path'\] it now reads 'files of /d v2'"):
    _states(entry, {"kind": "iter", "position": 5, "data": "files of /d v1"})
  assert "data" not in _states(_entry(None), {"data": "files of /d v1"})[0]  # names none


def test_a_glob_the_pipeline_walks_as_it_opens_stops_once_its_client_is_gone(tmp_path):
  """The feed's ``alive`` reaches the pipeline's glob as it opens (``produce(alive=)``): a
  client gone stops the walk, typed, before the pipeline returns (issue 70, item 2)."""
  from sidecar._src.user import data_roots
  for i in range(3):
    (tmp_path / f"d{i}").mkdir()
    (tmp_path / f"d{i}" / "x.bin").write_bytes(b"x")

  def pipeline(ctx):
    return [{"x": np.int32(len(ctx.data_path(f"{tmp_path}/*/*.bin").expand()))}] * 5
  spec = producer.Spec(global_batch_size=5, ranges=((0, 5),), seed=0, num_epochs=1,
                       shard_index=0, shard_count=1, start={}, workers=0)
  entry = registry_lib.Entry(kind=registry_lib.PIPELINE, name="p", fn=pipeline, code_hash="",
                             signature=None)
  roots = data_roots.DataRoots(roots=(str(tmp_path),), tenant="bob", where="pool.yaml:3")
  alloc = lambda shape, dtype: np.zeros(shape, dtype)
  with pytest.raises(sidecar.ClosedError, match="the feed's client is gone"):
    next(producer.produce(entry, {}, spec, alloc, roots=roots, alive=lambda: False))
  with pytest.raises(sidecar.ClosedError, match="the feed's client is gone"):
    producer.length(entry, {}, spec, roots, alive=lambda: False)
  batch, _, _ = next(producer.produce(entry, {}, spec, alloc, roots=roots, alive=lambda: True))
  np.testing.assert_array_equal(as_tree(batch)["x"][0], [3] * 5)


@pytest.mark.parametrize("loads,start,want", [
    ([2, 2, 2], 1, 1),  # all equal: the batch's turn
    ([2, 0, 1], 0, 1),  # the one with nothing to make, wherever the turn is
    ([1, 2, 1], 1, 2),  # equals after the turn before those before it
    ([3, 1, 1, 0], 2, 3),
], ids=["equal", "idle", "tie-after-turn", "fewest"])
def test_a_batch_goes_to_the_worker_with_the_fewest_to_make(loads, start, want):
  assert processes.least_busy(loads, start) == want
