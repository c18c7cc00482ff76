"""Pinned item directories (issue 54, attack 4): the ownership rule, its refusals, reads
of a tree others can change through no-symlink opens, the cache of the verdict, and saves
into a tree others can change or through a planted symlink."""

import os
import shutil

import numpy as np
import pytest

from sidecar._src.ckptfmt import pinned
from sidecar._src.ckptfmt.orbax import items, read as orbax_read, write as orbax_write
from sidecar._src.core import errors
from tests.support import orbax_steps
from tests.support.orbax_steps import SPECS, VALUES, W

pytestmark = pytest.mark.unit
OTHER = 65534  # nobody


def needs_root():
  if os.geteuid() != 0:
    pytest.skip("files of another user need root here (chown)")


def chown_tree(path, uid):
  for d, dirs, files in os.walk(path):
    for name in [*dirs, *files]:
      os.lchown(os.path.join(d, name), uid, uid)
  os.lchown(path, uid, uid)


@pytest.fixture
def item(tmp_path):
  items.clear()
  yield orbax_steps.write_step(tmp_path / "ck", 5) / "default"
  items.clear()


def verdict(path):
  with pinned.pin(path) as p:
    return p.untrusted


def test_a_tree_the_sidecar_wrote_passes(item):
  assert verdict(item) is None


@pytest.mark.parametrize("change", ["group-writable-dir", "world-writable-file", "symlink",
                                    "fifo", "other-owner"])
def test_each_break_of_the_rule_is_named(item, change):
  leaf = item / "opt.0.e"
  if change == "group-writable-dir":
    os.chmod(leaf, 0o775)
    path, why = leaf, "writable by its group or others"
  elif change == "world-writable-file":
    os.chmod(leaf / "0", 0o646)
    path, why = leaf / "0", "writable by its group or others"
  elif change == "symlink":
    (leaf / "0").unlink()
    (leaf / "0").symlink_to("/etc/hostname")
    path, why = leaf / "0", "a symlink"
  elif change == "fifo":
    os.mkfifo(leaf / "x")
    path, why = leaf / "x", "neither a plain file nor a directory"
  else:
    needs_root()
    os.chown(leaf / "1", OTHER, OTHER)
    path, why = leaf / "1", "not this sidecar's user"
  bad = verdict(item)
  assert bad is not None and bad.path == str(path) and why in bad.why, bad


def test_the_refusal_names_the_path_its_owner_and_mode_and_the_fix(item):
  needs_root()
  chown_tree(item, OTHER)
  with pinned.pin(item) as p:
    message = str(p.refusal("the read of leaf 'w'"))
  assert message.startswith(
      f"refusing the read of leaf 'w' through TensorStore, which opens files by path: "
      f"'{item}' belongs to user 'nobody' (uid {OTHER}) with mode drwxr-xr-x (not this "
      "sidecar's user (uid 0) nor root)"), message
  assert "umask 022" in message and "whole chunks of an uncompressed Zarr v2" in message


@pytest.mark.parametrize(("key_path", "index"), [
    (("w",), ((1, 7), (2, 5))), (("w",), None), (("opt", 0, "e"), ((3, 5),)),
    (("s",), None)], ids=["across-chunks", "whole-leaf", "edge-chunk", "scalar"])
def test_a_tree_others_can_change_is_read_beneath_with_the_same_result(
    item, monkeypatch, key_path, index):
  needs_root()
  chown_tree(item, OTHER)
  monkeypatch.setattr(orbax_read, "_read_leaf", None)  # never TensorStore's read
  with items.opened(item) as opened:
    assert opened.pinned.untrusted is not None and opened.context is None
    got = orbax_read._read_beneath(opened, ".".join(map(str, key_path)), index)
  expected = np.asarray(VALUES[key_path])
  if index is not None:
    expected = expected[tuple(slice(a, b) for a, b in index)]
  orbax_steps.assert_bit_exact(expected, got)


def test_in_a_tree_others_can_change_a_symlinked_chunk_is_refused_and_a_missing_one_filled(
    item):
  needs_root()
  (item / "w" / "0.0").unlink()  # all fill value: TensorStore stores no file
  (item / "w" / "1.1").unlink()
  (item / "w" / "1.1").symlink_to(item / "w" / "0.1")
  chown_tree(item, OTHER)
  got = orbax_read.read_item_leaf(item, ("w",), ((0, 2), (0, 6)))
  np.testing.assert_array_equal(got, np.concatenate([np.zeros((2, 3)), W[:2, 3:]], axis=1))
  with pytest.raises(errors.PermissionDeniedError, match=r"w/1\.1' is a symlink"):
    orbax_read.read_item_shard(item, ("w",), ((4, 8), (3, 6)))


def test_a_hard_link_in_a_tree_others_can_change_is_refused(item, tmp_path):
  needs_root()
  secret = tmp_path / "secret"
  secret.write_bytes(W[:4, :3].tobytes())
  (item / "w" / "0.0").unlink()
  os.link(secret, item / "w" / "0.0")
  chown_tree(item, OTHER)
  os.chown(secret, 0, 0)
  with pytest.raises(errors.PermissionDeniedError, match=r"0\.0' has 2 links"):
    orbax_read.read_item_shard(item, ("w",), ((0, 4), (0, 3)))


def test_other_arrays_in_a_tree_others_can_change_are_refused(item):
  needs_root()
  (item / "opt.0.e" / ".zarray").write_text(
      (item / "opt.0.e" / ".zarray").read_text().replace('"compressor":null',
                                                          '"compressor":{"id":"zstd"}'))
  chown_tree(item, OTHER)
  with pytest.raises(errors.PermissionDeniedError,
                     match=r"^refusing the read of leaf 'opt\.0\.e' through TensorStore"):
    orbax_read.read_item_leaf(item, ("opt", 0, "e"), ((0, 1),))


def test_the_verdict_is_cached_per_directory_and_walked_again_for_a_new_one(item, monkeypatch):
  walks = []
  check = pinned.check_tree
  monkeypatch.setattr(pinned, "check_tree", lambda fd, path: walks.append(path) or check(fd, path))
  for _ in range(3):
    orbax_read.read_item_leaf(item, ("w",), ((0, 1), (0, 1)))
    orbax_read.read_item_shard(item, ("w",), ((0, 4), (0, 3)))
  assert len(walks) == 1
  # The same path, another directory (a step deleted and written again): walked again.
  shutil.rmtree(item.parent)
  orbax_steps.write_step(item.parent.parent, 5)
  orbax_read.read_item_leaf(item, ("w",), ((0, 1), (0, 1)))
  assert walks.count(str(item)) == 2  # (the save walked its tmp item once too)


def test_a_save_through_a_planted_symlink_or_into_anothers_directory_is_refused(tmp_path):
  needs_root()
  victim = tmp_path / "victim"
  victim.mkdir()
  ck = tmp_path / "ck"
  ck.mkdir()
  os.chown(ck, OTHER, OTHER)
  tmp = ck / "5.orbax-checkpoint-tmp"
  tmp.symlink_to(victim)  # bob's link where the sidecar's tmp step was
  os.lchown(tmp, OTHER, OTHER)
  with pytest.raises(errors.PermissionDeniedError, match="refusing to follow the symlink"):
    orbax_write.write_host_part(tmp, 0, SPECS, orbax_steps.host_parts()[0])
  tmp.unlink()
  (tmp / "default").mkdir(parents=True)  # bob's own directories there instead
  chown_tree(tmp, OTHER)
  with pytest.raises(errors.PermissionDeniedError, match=r"^refusing the save into "):
    orbax_write.write_host_part(tmp, 0, SPECS, orbax_steps.host_parts()[0])
  assert os.listdir(victim) == [] and os.listdir(tmp / "default") == []
