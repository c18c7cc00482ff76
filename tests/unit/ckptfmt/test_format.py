"""The format seam: a new format is one ``Format`` subclass and one registry entry.

``NpyFormat`` here is a whole format (one ``.npy`` file per shard, a rename to commit) in
about forty lines, run through the sidecar's own save phases (``server/checkpoint/save``)
and read back by its ``read.Reader`` with nothing else changed: what a safetensors format
would do in ``ckptfmt/safetensors/``.
"""

import dataclasses
import os
import pathlib
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt import dir_fd, direct_io, records, registry as formats_lib
from sidecar._src.ckptfmt.format import Format, Uncommitted
from sidecar._src.ckptfmt.orbax.format import LeafNumbering
from sidecar._src.ckptfmt.records import shard_crc32c
from sidecar._src.ckptfmt.save_values import Begin, Commit, Prepared, Stage
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import (
  ram_tier,
  read as checkpoint_read,
  roots as roots_lib,
  save as checkpoint_save,
)
from sidecar._src.server.checkpoint.caller import Caller
from tests.support.staged import staged

pytestmark = pytest.mark.unit

SUFFIX = ".npy-checkpoint-tmp"


def _file(directory, key_path, index) -> pathlib.Path:
  return pathlib.Path(directory) / (".".join(map(str, key_path)) + "@"
                                    + "_".join(f"{a}-{b}" for a, b in index) + ".npy")


class NpyFormat(Format):
  name, tmp_suffix, overwrites = "npy", SUFFIX, False

  def create_tmp(self, directory, step, *, at=None):
    # Made, like everything a format renames or removes, relative to ``at``: the directory
    # it lies in, opened by the sidecar from its root (a symlink swapped in is not followed).
    tmp = pathlib.Path(self.tmp_of(directory, step))
    with dir_fd.held(at, tmp.parent, make=True) as d:
      d.rmtree(tmp.name)
      d.mkdir(tmp.name)
    return tmp

  def tmp_of(self, directory, step):
    return os.path.join(directory, f"{step}{SUFFIX}")

  def final_of(self, path):
    if not path.name.endswith(SUFFIX):
      return None
    final = path.with_name(path.name.removesuffix(SUFFIX))
    return Uncommitted(path, final, final)

  def is_checkpoint(self, path):
    return (path / records.MANIFEST_FILE).is_file() and any(path.glob("*.npy"))

  def numbering(self, leaves):
    return LeafNumbering(leaves)

  def write(self, tmp_dir, host_id, numbering, incoming, *, progress, turn):
    sums = []
    for s in incoming:
      with turn(s.data.nbytes):
        np.save(_file(tmp_dir, s.record.key_path, s.record.index), s.data)
      progress(s.data.nbytes)
      sums.append(s.record.with_crc32c(shard_crc32c(s.data)))
    return sums

  def commit(self, commit, manifest, *, swapping, at=None):
    tmp_dir = commit.tmp_dir
    direct_io.write_small(pathlib.Path(tmp_dir) / records.MANIFEST_FILE,
                          manifest.to_json().encode())
    final = tmp_dir.removesuffix(SUFFIX)
    with dir_fd.held(at, os.path.dirname(tmp_dir)) as d:
      d.rename(os.path.basename(tmp_dir), os.path.basename(final))
    return final

  def read(self, final_dir, record, *, allocate, manifest):
    stored = np.load(_file(final_dir, record.key_path, record.index))
    out = allocate(stored.shape, stored.dtype)
    out[...] = stored
    return out


def test_a_new_format_is_one_subclass_and_one_registry_entry(tmp_path):
  formats = formats_lib.DEFAULT.replacing(NpyFormat())
  threads = []

  def spawn(target, *args, name):
    threads.append(threading.Thread(target=target, args=args, name=name))
    threads[-1].start()

  tier = ram_tier.RamTier(0, uncommitted_s=3600.0)
  writer = checkpoint_save.StepWriter(0, tier=tier, roots=roots_lib.Roots(0, (str(tmp_path),)),
                           spawn=spawn, metrics=metrics_lib.Recorder(), formats=formats)
  spec = LeafSpec(key_path=("w",), shape=(4, 2), dtype=np.float32, write_shape=(2, 2))
  w = np.arange(8, dtype=np.float32).reshape(4, 2)
  directory = str(tmp_path / "ck")
  writer.open(directory)
  tmp = writer.begin(Begin(directory, 5, "npy"), Caller(owner="a"))
  final = tmp.removesuffix(SUFFIX)
  writer.stage(Stage(directory, 5, tmp, final, [spec], [staged(("w",), 0, ((0, 2), (0, 2)), w[:2])],
                     last=False), Caller(owner="a"))
  writer.stage(Stage(directory, 5, tmp, final, [spec], [staged(("w",), 0, ((2, 4), (0, 2)), w[2:])],
                     last=True), Caller(owner="a"))
  sums = writer.prepared(Prepared(final), Caller(wait_s=30))
  assert writer.commit(Commit(tmp_dir=tmp, step=5, num_hosts=1, leaves=[spec], shards=sums,
                              data_state_json="", whole_step=True), Caller(owner="a")) == final
  for t in threads:
    t.join(30)
  assert writer.open(directory) == [5]  # listed as a step: its format says it is one
  manifest = checkpoint_read.info(final, formats)
  assert manifest.format == "npy" and {c.index for c in manifest.shards} == {
      ((0, 2), (0, 2)), ((2, 4), (0, 2))}
  reader = checkpoint_read.Reader(tier, metrics_lib.Recorder(), formats)
  written = {r.index: r for r in manifest.shards}  # the records a restore reads by
  got = reader.read(final, written[((2, 4), (0, 2))], tier="disk")
  np.testing.assert_array_equal(got, w[2:])
  with pytest.raises(errors.CorruptCheckpointError, match="does not match its crc32c"):
    reader.read(final, written[((0, 2), (0, 2))].with_crc32c(1), tier="disk")
  with pytest.raises(errors.CorruptCheckpointError,
                     match=r"came from the stored copy as float32\[2, 2\], where the save "
                           r"wrote float64\[2, 2\]"):
    reader.read(final, dataclasses.replace(written[((0, 2), (0, 2))], dtype="float64"),
                tier="disk")
