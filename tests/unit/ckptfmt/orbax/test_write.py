"""The write engine: each host's shards into the step's chunk files, checksummed.

Real files in tmp_path, real TensorStore for the edge and scalar chunks.
"""

import contextlib
import dataclasses
import json

import numpy as np
import pytest

from sidecar._src.ckptfmt import spec as spec_lib
from sidecar._src.ckptfmt.orbax import commit as orbax_commit, write as orbax_write
from sidecar._src.ckptfmt.records import shard_crc32c
from sidecar._src.core import errors
from tests.support import orbax_steps
from tests.support.orbax_steps import SPECS, E, W
from tests.support.staged import staged

pytestmark = pytest.mark.unit


@pytest.fixture
def tmp(tmp_path):
  return orbax_commit.create_tmp_step(tmp_path, 5)


def test_whole_chunks_land_in_their_files_as_c_order_bytes(tmp):
  orbax_write.write_host_part(tmp, 1, SPECS, orbax_steps.host_parts()[1])
  w = tmp / "default" / "w"
  assert sorted(p.name for p in w.iterdir()) == ["1.0", "1.1"]  # host 1 writes no .zarray
  assert (w / "1.0").read_bytes() == W[4:, :3].tobytes()
  assert (w / "1.1").read_bytes() == W[4:, 3:].tobytes()
  orbax_write.write_host_part(tmp, 0, SPECS, orbax_steps.host_parts()[0])
  assert sorted(p.name for p in w.iterdir()) == [".zarray", "0.0", "0.1", "1.0", "1.1"]
  assert json.loads((w / ".zarray").read_text())["chunks"] == [4, 3]
  # The edge chunk (4:5 of chunk 2) went through TensorStore, padded to a whole chunk.
  assert (tmp / "default" / "opt.0.e" / "2").stat().st_size == 2 * E.itemsize


def test_the_records_come_written_in_the_order_given_with_the_index_resolved(tmp):
  part = orbax_steps.host_parts()[0]
  sums = orbax_write.write_host_part(tmp, 0, SPECS, part)
  assert [(s.key_path, s.index) for s in sums] == [
      (("w",), ((0, 4), (0, 3))), (("w",), ((0, 4), (3, 6))),
      (("opt", 0, "e"), ((0, 2),)), (("opt", 0, "e"), ((4, 5),))]
  for s, shard in zip(sums, part):
    assert s.crc32c == shard_crc32c(shard.data)
    # The staged record, its crc32c set (its index normalized: a slice becomes a pair).
    assert dataclasses.replace(s, crc32c=None, id=shard.record.id) == shard.record


def test_write_item_part_takes_shards_as_they_arrive_and_reports_progress(tmp):
  """A generator of shards: the sidecar feeds them to the writer as they are staged."""
  done = []
  arrived = []

  def coming():
    for shard in [staged(("w",), 0, ((0, 4), (0, 3)), W[:4, :3]),
                  staged(("s",), 2, (), np.asarray(0.5))]:
      arrived.append(shard.record.leaf)
      yield shard

  sums = orbax_write.write_item_part(tmp / "default", 0, SPECS, coming(), progress=done.append)
  assert arrived == [0, 2] and len(sums) == 2
  assert sorted(done) == [8, 48]  # each shard's bytes once it is durable


def test_every_shard_is_written_in_a_turn_of_its_bytes(tmp):
  """With a turn (a pool tenant's share of the storage), each shard's bytes are written
  holding one: whole chunks and the edge chunk TensorStore writes alike."""
  held, turns = [], []

  @contextlib.contextmanager
  def turn(nbytes):
    turns.append(nbytes)
    held.append(nbytes)
    try:
      yield
    finally:
      held.remove(nbytes)

  part = orbax_steps.host_parts()[0]
  orbax_write.write_item_part(tmp / "default", 0, SPECS, part, turn=turn)
  assert sorted(turns) == sorted(shard.data.nbytes for shard in part)
  assert held == []
  assert (tmp / "default" / "opt.0.e" / "2").stat().st_size == 2 * E.itemsize  # the edge


def test_array_metadatas_are_written_per_host_for_jax_arrays_only(tmp):
  orbax_write.write_host_part(tmp, 0, SPECS, orbax_steps.host_parts()[0])
  assert not (tmp / "default" / "array_metadatas").exists()  # numpy and scalar leaves only
  spec = spec_lib.LeafSpec(key_path=("j",), shape=(4,), dtype=np.int8, write_shape=(2,))
  orbax_write.write_host_part(tmp, 3, [spec], [staged(("j",), 0, ((2, 4),), np.ones(2, np.int8))])
  [meta] = json.loads((tmp / "default" / "array_metadatas" / "process_3").read_text())[
      "array_metadatas"]
  assert meta["array_metadata"]["param_name"] == "j"
  assert meta["array_metadata"]["write_shape"] == [2]


SPEC = spec_lib.LeafSpec(key_path=("a",), shape=(4, 6), dtype=np.float32, write_shape=(2, 3))


@pytest.mark.parametrize(("shard", "match"), [
    ((((0, 2), (0, 3)), np.zeros((2, 2), np.float32)),
     r"expected \(2, 3\) float32, got \(2, 2\) float32"),
    ((((0, 2), (0, 3)), np.zeros((2, 3), np.float64)),
     r"expected \(2, 3\) float32, got \(2, 3\) float64"),
    ((((1, 3), (0, 3)), np.zeros((2, 3), np.float32)),
     r"not one block of write_shape \(2, 3\)"),
    (((slice(0, 4, 2), slice(0, 3)), np.zeros((2, 3), np.float32)), r"has a stride"),
    ((((0, 2),), np.zeros((2,), np.float32)), r"has 1 entries for a 2-d array"),
], ids=["shape", "dtype", "misaligned", "strided", "rank"])
def test_write_host_part_rejects_bad_shards(tmp_path, shard, match):
  tmp = orbax_commit.create_tmp_step(tmp_path, 0)
  with pytest.raises(errors.InvalidArgumentError, match=match):
    orbax_write.write_host_part(tmp, 0, [SPEC], [staged(("a",), 0, *shard)])


@pytest.mark.parametrize("host_index", [-1, 1.0, "0", True],
                         ids=["negative", "float", "str", "bool"])
def test_the_host_index_is_an_int(tmp, host_index):
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"^host_index must be an int >= 0, got {host_index!r}$"):
    orbax_write.write_host_part(tmp, host_index, [], [])
  assert not (tmp / "default").exists()


@pytest.mark.parametrize("leaf", [3, -1, "0"], ids=["past-the-end", "negative", "str"])
def test_a_shard_names_a_leaf_of_the_tree(tmp, leaf):
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"^shard of leaf {leaf!r}: there are 3 leaves$"):
    orbax_write.write_item_part(tmp / "default", 0, SPECS,
                                [staged(("s",), leaf, (), np.asarray(0.5))])


def test_the_same_leaf_twice_is_refused(tmp):
  with pytest.raises(errors.InvalidArgumentError, match=r"^leaf 'w' is given twice$"):
    orbax_write.write_host_part(tmp, 0, [SPECS[0], SPECS[0]], [])


def test_only_an_uncommitted_step_is_written(tmp_path):
  orbax_steps.write_step(tmp_path, 5)
  with pytest.raises(errors.InvalidArgumentError, match=r"5 is not an uncommitted step directory"):
    orbax_write.write_host_part(tmp_path / "5", 0, SPECS, orbax_steps.host_parts()[0])


def test_tensorstore_writes_into_no_leaf_directory_holding_a_symlink(tmp, tmp_path):
  """Issue 42's gap (b), writing: an edge chunk's file planted as a symlink to a file
  outside the checkpoint: TensorStore wrote through it. Now the write is refused, naming
  the link, and the file outside is as it was."""
  outside = tmp_path / "outside"
  outside.write_bytes(b"keep")
  leaf = tmp / "default" / "opt.0.e"
  leaf.mkdir(parents=True)
  (leaf / "2").symlink_to(outside)
  with pytest.raises(errors.PermissionDeniedError, match=rf"'{leaf / '2'}' is a symlink"):
    orbax_write.write_host_part(tmp, 0, SPECS, orbax_steps.host_parts()[0])
  assert outside.read_bytes() == b"keep"
