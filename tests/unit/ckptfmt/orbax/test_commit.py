"""Committing a step: nothing is a step until the one rename, and what it leaves is
stock Orbax's.

Real files in tmp_path; stock Orbax restores what was committed.
"""

import base64
import json
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

from sidecar._src.ckptfmt import spec as spec_lib
from sidecar._src.ckptfmt.orbax import (
  commit as orbax_commit,
  read as orbax_read,
  write as orbax_write,
)
from sidecar._src.core import errors
from tests.support import orbax_steps
from tests.support.orbax_steps import SPECS
from tests.support.staged import staged

pytestmark = pytest.mark.unit

HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"


def read_json(path):
  return json.loads(path.read_text())


def orbax_steps_seen(directory):
  options = ocp.CheckpointManagerOptions(cleanup_tmp_directories=False, create=False)
  with ocp.CheckpointManager(directory, options=options) as mgr:
    return mgr.all_steps()


def test_the_tmp_step_is_orbax_named_with_its_step_metadata(tmp_path):
  tmp = orbax_commit.create_tmp_step(tmp_path, 7)
  assert tmp == tmp_path / "7.orbax-checkpoint-tmp" and tmp.is_dir()
  meta = read_json(tmp / "_CHECKPOINT_METADATA")
  assert meta["item_handlers"] == {"default": HANDLER}
  assert meta["init_timestamp_nsecs"] > 0 and meta["commit_timestamp_nsecs"] is None


def test_no_step_is_visible_until_the_rename(tmp_path):
  """Written by every host and its item finalized, the step is still not a step, to us
  or to stock Orbax; finalize makes it one."""
  tmp = orbax_commit.create_tmp_step(tmp_path, 5)
  for host, part in enumerate(orbax_steps.host_parts()):
    orbax_write.write_host_part(tmp, host, SPECS, part)
  orbax_commit.finalize_item(tmp / "default", SPECS, num_hosts=2)
  assert (tmp / "default" / "commit_success.txt").is_file()
  assert orbax_read.list_steps(tmp_path) == [] and orbax_steps_seen(tmp_path) == []
  assert sorted(p.name for p in tmp_path.iterdir()) == ["5.orbax-checkpoint-tmp"]
  init = read_json(tmp / "_CHECKPOINT_METADATA")["init_timestamp_nsecs"]
  final = orbax_commit.finalize(tmp, SPECS, num_hosts=2)
  assert final == tmp_path / "5" and not tmp.exists()
  assert orbax_read.list_steps(tmp_path) == [5] and orbax_steps_seen(tmp_path) == [5]
  meta = read_json(final / "_CHECKPOINT_METADATA")
  assert meta["init_timestamp_nsecs"] == init <= meta["commit_timestamp_nsecs"]
  assert (final / "commit_success.txt").read_text() == (
      f"Checkpoint commit was successful to {final}")


def test_stock_orbax_restores_the_committed_step_bit_exact(tmp_path):
  orbax_steps.write_step(tmp_path, 5)
  with ocp.CheckpointManager(tmp_path) as mgr:
    restored = mgr.restore(5, args=ocp.args.StandardRestore())
  assert restored.keys() == {"w", "opt", "s"}
  orbax_steps.assert_bit_exact(orbax_steps.W, restored["w"])
  orbax_steps.assert_bit_exact(orbax_steps.E, restored["opt"][0]["e"])
  assert restored["s"] == orbax_steps.S


def test_the_tree_metadata_is_orbax_s(tmp_path):
  final = orbax_steps.write_step(tmp_path, 5, custom_metadata={"data_state": [1, "a"]})
  meta = read_json(final / "default" / "_METADATA")
  assert list(meta["tree_metadata"]) == ["('w',)", "('opt', '0', 'e')", "('s',)"]  # tree order
  entry = meta["tree_metadata"]["('opt', '0', 'e')"]
  assert entry["key_metadata"] == [{"key": "opt", "key_type": 2}, {"key": "0", "key_type": 1},
                                   {"key": "e", "key_type": 2}]  # dict key, sequence index
  assert [e["value_metadata"]["value_type"] for e in meta["tree_metadata"].values()] == [
      "np.ndarray", "np.ndarray", "scalar"]
  assert (meta["use_ocdbt"], meta["use_zarr3"]) == (False, False)
  assert meta["custom_metadata"] == {"data_state": [1, "a"]}
  assert not (final / "default" / "_sharding").exists()  # no leaf has a sharding


def test_shardings_are_stored_by_base64_param_name(tmp_path):
  sharding = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": "TFRT_CPU_0"})
  spec = spec_lib.LeafSpec(key_path=("opt", 0), shape=(2,), dtype=np.int32, write_shape=(2,),
                              sharding=sharding)
  tmp = orbax_commit.create_tmp_step(tmp_path, 1)
  orbax_write.write_host_part(tmp, 0, [spec],
                              [staged(("opt", 0), 0, ((0, 2),), np.arange(2, dtype=np.int32))])
  final = orbax_commit.finalize(tmp, [spec], num_hosts=1)
  assert read_json(final / "default" / "_sharding") == {
      base64.urlsafe_b64encode(b"opt.0").decode(): sharding}
  meta = read_json(final / "default" / "_METADATA")["tree_metadata"]["('opt', '0')"]
  assert meta["value_metadata"]["write_shape"] == [2]  # a jax.Array's write shape


def test_a_step_already_committed_is_not_begun_again(tmp_path):
  orbax_steps.write_step(tmp_path, 5)
  with pytest.raises(FileExistsError, match=rf"^step 5 is already committed at {tmp_path}/5$"):
    orbax_commit.create_tmp_step(tmp_path, 5)


def test_a_step_committed_meanwhile_is_left_alone(tmp_path):
  """Two commits of one step: the second fails before the rename, touching neither."""
  orbax_steps.write_step(tmp_path, 5)
  shutil.move(tmp_path / "5", tmp_path / "winner")
  tmp = orbax_commit.create_tmp_step(tmp_path, 5)
  for host, part in enumerate(orbax_steps.host_parts()):
    orbax_write.write_host_part(tmp, host, SPECS, part)
  shutil.move(tmp_path / "winner", tmp_path / "5")
  with pytest.raises(FileExistsError, match=r"^step 5 was committed meanwhile at "):
    orbax_commit.finalize(tmp, SPECS, num_hosts=2)
  assert tmp.is_dir() and orbax_read.list_steps(tmp_path) == [5]


def test_a_leaf_no_host_wrote_is_named(tmp_path):
  tmp = orbax_commit.create_tmp_step(tmp_path, 5)
  for host, part in enumerate(orbax_steps.host_parts()):
    no_s = [s for s in part if s.record.leaf < 2]
    orbax_write.write_host_part(tmp, host, SPECS[:2], no_s)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"^step at .*/5\.orbax-checkpoint-tmp is incomplete: leaf 's' has 0 "
                           r"of 1 chunks \(metadata written: False\); some host did not write"):
    orbax_commit.finalize(tmp, SPECS, num_hosts=2)
  assert orbax_read.list_steps(tmp_path) == [] and not (tmp / "commit_success.txt").exists()


def test_hosts_that_disagree_on_the_arrays_are_refused(tmp_path):
  j = spec_lib.LeafSpec(key_path=("j",), shape=(4,), dtype=np.int8, write_shape=(2,))
  k = spec_lib.LeafSpec(key_path=("k",), shape=(4,), dtype=np.int8, write_shape=(4,))
  tmp = orbax_commit.create_tmp_step(tmp_path, 1)
  orbax_write.write_host_part(tmp, 0, [j, k], [staged(("j",), 0, ((0, 2),), np.zeros(2, np.int8)),
                                               staged(("k",), 1, ((0, 4),), np.zeros(4, np.int8))])
  orbax_write.write_host_part(tmp, 1, [j], [staged(("j",), 0, ((2, 4),), np.zeros(2, np.int8))])
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"^host 1 wrote metadata for \['j'\], expected \['j', 'k'\]$"):
    orbax_commit.finalize(tmp, [j, k], num_hosts=2)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"expected the parts of 3 hosts in .*, found \['process_0', "
                           r"'process_1'\]; run write_host_part on every host"):
    orbax_commit.finalize(tmp, [j, k], num_hosts=3)


def test_only_an_uncommitted_step_is_finalized(tmp_path):
  final = orbax_steps.write_step(tmp_path, 5)
  with pytest.raises(errors.InvalidArgumentError, match=r"is not an uncommitted step directory"):
    orbax_commit.finalize(final, SPECS, num_hosts=2)
