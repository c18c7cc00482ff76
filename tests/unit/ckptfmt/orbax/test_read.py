"""The read path on a step written here: leaves, blocks and shards read back bit-exact,
whole chunks straight from their files into the caller's array.

Stock Orbax's own layouts (OCDBT, zstd) are read in test_orbax_layout.py.
"""

import os

import numpy as np
import pytest

from sidecar._src.ckptfmt import direct_io
from sidecar._src.ckptfmt.orbax import read as orbax_read
from sidecar._src.core import errors
from tests.support import orbax_steps
from tests.support.orbax_steps import VALUES, E, W

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def step(tmp_path_factory):
  return orbax_steps.write_step(tmp_path_factory.mktemp("read"), 5)


@pytest.mark.parametrize("key_path", list(VALUES), ids=lambda k: ".".join(map(str, k)))
def test_read_leaf_reads_each_leaf_back_bit_exact(step, key_path):
  orbax_steps.assert_bit_exact(VALUES[key_path], orbax_read.read_leaf(step, key_path))


@pytest.mark.parametrize(("index", "block"), [
    ((slice(2, 6), slice(1, 5)), np.s_[2:6, 1:5]), (((2, 6), (1, 5)), np.s_[2:6, 1:5]),
    ([(0, 8), (5, 6)], np.s_[:, 5:]),
], ids=["slices", "pairs", "column"])
def test_read_leaf_reads_a_block_across_chunks(step, index, block):
  orbax_steps.assert_bit_exact(W[block], orbax_read.read_leaf(step, ("w",), index))


class Allocations:
  def __init__(self):
    self.made = []

  def __call__(self, shape, dtype):
    self.made.append(np.full(shape, 255, dtype))
    return self.made[-1]


def test_a_whole_chunk_is_read_from_its_file_into_the_callers_array(step, monkeypatch):
  read = []
  read_at = direct_io.read_at
  monkeypatch.setattr(direct_io, "read_at", lambda fd, out, at: read.append(
      os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))) or read_at(fd, out, at))
  allocate = Allocations()
  got = orbax_read.read_item_shard(step / "default", ("w",), ((4, 8), (3, 6)), allocate=allocate)
  assert got is allocate.made[0] and read == ["1.1"]
  orbax_steps.assert_bit_exact(W[4:, 3:], got)


@pytest.mark.parametrize(("key_path", "index"), [
    (("opt", 0, "e"), ((4, 5),)), (("w",), ((0, 8), (0, 3))), (("s",), ())],
    ids=["edge-chunk", "two-chunks", "scalar"])
def test_other_blocks_go_through_tensorstore(step, monkeypatch, key_path, index):
  monkeypatch.setattr(direct_io, "read_at", None)  # never called
  allocate = Allocations()
  got = orbax_read.read_item_shard(step / "default", key_path, index, allocate=allocate)
  orbax_steps.assert_bit_exact(np.asarray(VALUES[key_path])[tuple(slice(a, b) for a, b in index)],
                               got)
  assert allocate.made == []


def test_a_chunk_file_of_the_wrong_size_is_corrupt(tmp_path):
  item = orbax_steps.write_step(tmp_path, 5) / "default"
  (item / "opt.0.e" / "1").write_bytes(E[2:4].tobytes() + b"\0")
  with pytest.raises(errors.CorruptCheckpointError,
                     match=r"opt\.0\.e/1 holds 9 bytes where the chunk \[\[2, 4\]\] of "
                           r"'opt\.0\.e' takes 8: the file is corrupt or was changed after the "
                           r"save"):
    orbax_read.read_item_shard(item, ("opt", 0, "e"), ((2, 4),))


def test_a_missing_chunk_file_is_file_not_found(tmp_path):
  """TensorStore says NOT_FOUND in a ValueError; a restore must read it as a copy that
  is not there (the shard is lost only then), not as a failure of another kind."""
  item = orbax_steps.write_step(tmp_path, 5) / "default"
  (item / "opt.0.e" / "1").unlink()
  with pytest.raises(FileNotFoundError, match=r"^leaf 'opt\.0\.e' of .*/default: NOT_FOUND"):
    orbax_read.read_item_shard(item, ("opt", 0, "e"), ((2, 4),))


def test_missing_steps_and_leaves_are_named(step, tmp_path):
  with pytest.raises(FileNotFoundError, match=r"^leaf 'opt\.1' is not in the checkpoint at .*/5/"
                                              r"default$"):
    orbax_read.read_leaf(step, ("opt", 1))
  with pytest.raises(FileNotFoundError, match=r"^leaf 'x' is not in the checkpoint"):
    orbax_read.read_item_shard(step / "default", ("x",), ((0, 1),))
  with pytest.raises(FileNotFoundError, match=rf"^no checkpoint item at {tmp_path}/9/default "
                                              r"\(_METADATA is missing\)$"):
    orbax_read.read_leaf(tmp_path / "9", ("w",))


def test_item_leaves_lists_every_leaf_without_reading_data(step):
  assert orbax_read.item_leaves(step / "default") == [
      {"key_path": ["w"], "shape": [8, 6], "dtype": "float32", "kind": "np.ndarray"},
      {"key_path": ["opt", 0, "e"], "shape": [5], "dtype": "int32", "kind": "np.ndarray"},
      {"key_path": ["s"], "shape": [], "dtype": "float64", "kind": "scalar"},
  ]


def test_list_steps_lists_committed_step_directories_in_numeric_order(tmp_path):
  assert orbax_read.list_steps(tmp_path / "missing") == []
  for name in ("10", "9", "100", "3.orbax-checkpoint-tmp", "notes", "-1"):
    (tmp_path / name).mkdir()
  (tmp_path / "7").write_text("a file named like a step")
  assert orbax_read.list_steps(tmp_path) == [9, 10, 100]


def test_tensorstore_is_never_handed_a_leaf_directory_with_a_symlink(tmp_path):
  """Issue 42's gap (b): TensorStore opens a leaf's files by path and follows a symlink
  planted among them (an edge chunk swapped for a link to a file outside): the read
  returned that file's bytes. Now the leaf's directory is walked first (lstat) and the
  read refused, naming the link."""
  step = orbax_steps.write_step(tmp_path / "ck", 5)
  secret = tmp_path / "secret"
  secret.write_bytes(np.array([7, 7], np.int32).tobytes())  # an edge chunk's size
  chunk = step / "default" / "opt.0.e" / "2"
  chunk.unlink()
  chunk.symlink_to(secret)
  for read in (lambda: orbax_read.read_leaf(step, ("opt", 0, "e")),
               lambda: orbax_read.read_item_shard(step / "default", ("opt", 0, "e"), ((4, 5),))):
    with pytest.raises(errors.PermissionDeniedError,
                       match=rf"'{chunk}' is a symlink.* a checkpoint holds no symlinks"):
      read()
  # Its metadata is read beneath the item, no symlink followed: the link is no matter.
  assert len(orbax_read.item_leaves(step / "default")) == 3
