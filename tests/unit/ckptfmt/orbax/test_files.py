"""What the write, commit and read paths share: item directory, write specs, chunk
names, durable small files."""

import os

import numpy as np
import pytest

from sidecar._src.ckptfmt import direct_io, spec as spec_lib
from sidecar._src.ckptfmt.orbax import files
from sidecar._src.core import errors

pytestmark = pytest.mark.unit


def spec(key_path, shape=(8, 6), write_shape=(4, 3)):
  return spec_lib.LeafSpec(key_path=key_path, shape=shape, dtype=np.float32,
                              write_shape=write_shape)


def test_the_item_of_a_tmp_step_is_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  item = files.item_dir("ck/3.orbax-checkpoint-tmp", must_be_tmp=True)
  assert item == tmp_path / "ck" / "3.orbax-checkpoint-tmp" / "default"  # TensorStore wants it so
  assert files.item_dir(tmp_path / "3", must_be_tmp=False) == tmp_path / "3" / "default"


@pytest.mark.parametrize("name", ["3", "3.orbax-checkpoint-tmp.old", "default"],
                         ids=["committed", "suffix-not-last", "item"])
def test_writing_needs_an_uncommitted_step(tmp_path, name):
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"^{tmp_path}/{name} is not an uncommitted step directory \(name must "
                           r"end with '\.orbax-checkpoint-tmp'\); create one with create_tmp_step"):
    files.item_dir(tmp_path / name, must_be_tmp=True)


def test_two_leaves_with_one_orbax_name_are_refused():
  """("opt", 0) and ("opt.0",) would share the directory ``opt.0``."""
  files.check_unique([spec(("opt", 0)), spec(("opt", 1))])
  with pytest.raises(errors.InvalidArgumentError, match=r"^leaf 'opt\.0' is given twice$"):
    files.check_unique([spec(("opt", 0)), spec(("w",)), spec(("opt.0",))])


@pytest.mark.parametrize(("index", "chunk", "separator", "name"), [
    (((0, 4), (3, 6)), (4, 3), ".", "0.1"),
    (((4, 8), (3, 6)), (4, 3), "/", "1/1"),
    (((8, 10),), (2,), ".", "4"),
    (((1, 5), (0, 3)), (4, 3), ".", None),
    (((0, 4), (0, 6)), (4, 3), ".", None),
    (((4, 5),), (2,), ".", None),
    ((), (), ".", None),
    (((0, 4),), (4, 3), ".", None),
], ids=["first-row", "slash-separator", "1d", "misaligned", "two-chunks", "edge", "scalar",
        "rank-mismatch"])
def test_a_block_names_its_chunk_file_only_if_it_is_one_whole_chunk(index, chunk, separator,
                                                                     name):
  assert files.whole_chunk(index, chunk, separator) == name


@pytest.mark.parametrize("compression", [False, True], ids=["raw", "zstd"])
def test_the_write_spec_is_zarr2_chunked_by_write_shape_under_the_item(tmp_path, compression):
  w = files.write_spec(tmp_path, spec(("opt", 0, "mu")), 1, compression)
  assert w.json["driver"] == "zarr" and w.json["kvstore"] == {
      "driver": "file", "path": f"{tmp_path}/opt.0.mu"}
  assert tuple(w.metadata.chunk_shape) == tuple(w.json["metadata"]["chunks"]) == (4, 3)
  assert (w.json["metadata"]["compressor"] is not None) == compression
  assert (w.metadata.use_ocdbt, w.metadata.use_zarr3) == (False, False)


def test_write_text_makes_its_directory_and_replaces_the_file(tmp_path):
  path = tmp_path / "a" / "b" / "commit_success.txt"
  files.write_text(path, "first, longer text")
  files.write_text(path, "second")
  assert path.read_text() == "second"
  direct_io.fsync_dir(path.parent)


def test_fsync_dir_wants_a_directory(tmp_path):
  (tmp_path / "f").write_text("")
  with pytest.raises(NotADirectoryError):
    direct_io.fsync_dir(tmp_path / "f")
  with pytest.raises(FileNotFoundError):
    direct_io.fsync_dir(tmp_path / "missing")
  assert os.listdir(tmp_path) == ["f"]
