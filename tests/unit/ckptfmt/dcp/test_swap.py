"""A DCP commit over a committed checkpoint (issue 35 item 4): one atomic swap where the
file system has one (``renameat2``'s exchange), and where it has none, two renames whose
cut-short state the next open or save recovers, never deleting the only complete copy."""

import os

import pytest

from sidecar._src.ckptfmt.dcp import commit as dcp_commit, distcp
from tests.support import races

pytestmark = pytest.mark.unit

META = b"\x80\x04N."  # a pickle's first bytes: finalize checks only those


class Killed(Exception):
  pass


def commit(path, tag, **kw):
  tmp = dcp_commit.create_tmp(path)
  (tmp / "tag").write_text(tag)
  return dcp_commit.finalize(tmp, metadata=META, file_sizes={}, **kw)


def test_an_overwrite_swaps_in_one_step_and_leaves_only_the_new_copy(tmp_path):
  path = tmp_path / "ckpt"
  commit(path, "old")
  seen = []
  commit(path, "new", swapping=lambda: seen.append(sorted(os.listdir(tmp_path))))
  # At the swap's point both copies are whole: the new at the path, the old at the tmp name.
  assert seen == [["ckpt", "ckpt" + distcp.TMP_SUFFIX]]
  assert (path / "tag").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_without_an_exchange_a_cut_overwrite_is_recovered_not_deleted(tmp_path, monkeypatch):
  monkeypatch.setattr(dcp_commit, "_exchange", lambda d, a, b: False)
  path = tmp_path / "ckpt"
  commit(path, "old")

  def die():
    raise Killed
  with pytest.raises(Killed):  # between the two renames: nothing at the path
    commit(path, "new", swapping=die)
  assert not path.exists() and distcp.is_checkpoint(dcp_commit.old_path(path))
  assert dcp_commit.recover(path) and (path / "tag").read_text() == "old"
  assert not dcp_commit.recover(path)  # nothing more to recover
  with pytest.raises(Killed):
    commit(path, "new", swapping=die)
  commit(path, "newer")  # the next save puts the old copy back first, then replaces it
  assert (path / "tag").read_text() == "newer" and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_sibling_no_save_made_is_never_removed(tmp_path):
  """STYLE 27 (issue 42, attack 14): ``<path>.dcp-checkpoint-tmp`` and ``-old`` are removed
  only where a save made them; anything else in their place stays, and the save is
  refused naming it."""
  from sidecar._src.ckptfmt.dcp.format import DcpFormat
  from sidecar._src.core import errors
  path = tmp_path / "ckpt"
  planted = dcp_commit.tmp_path(path) / "keep.txt"
  planted.parent.mkdir()
  planted.write_text("keep")
  with pytest.raises(errors.PermissionDeniedError, match="was not made by one"):
    dcp_commit.create_tmp(path)
  assert DcpFormat().sweep(tmp_path) == []  # an open's sweep passes it by
  assert planted.read_text() == "keep"
  planted.unlink()
  planted.parent.rmdir()
  tmp = dcp_commit.create_tmp(path)  # a save's own leftover is removed and made anew
  (tmp / "partial").write_text("x")
  assert DcpFormat().sweep(tmp_path) == [tmp]
  commit(path, "one")
  assert sorted(os.listdir(path)) == [distcp.METADATA_FILE, "tag"]  # the mark is gone


def test_a_cut_overwrite_another_host_puts_back_first_is_left_to_it(tmp_path, monkeypatch):
  """Two sidecars open one directory at once after an overwrite was cut short: both find
  the old copy to put back, the other renames it first. This open's own rename then
  found nothing (ENOENT failed the open); the copy is back, which is all it asked."""
  from sidecar._src.ckptfmt.dcp.format import DcpFormat
  monkeypatch.setattr(dcp_commit, "_exchange", lambda d, a, b: False)
  path = tmp_path / "ckpt"
  commit(path, "old")

  def die():
    raise Killed
  with pytest.raises(Killed):
    commit(path, "new", swapping=die)
  real, old = dcp_commit._is_checkpoint_in, dcp_commit.old_path(path)

  def other_host_first(d, name):
    found = real(d, name)
    if found and name == old.name:
      os.rename(old, path)  # the other sidecar's recover, between this one's check and rename
    return found
  monkeypatch.setattr(dcp_commit, "_is_checkpoint_in", other_host_first)
  assert DcpFormat().sweep(tmp_path) == [path.with_name("ckpt" + distcp.TMP_SUFFIX)]
  assert (path / "tag").read_text() == "old" and not old.exists()


def test_a_leftover_another_host_removes_meanwhile_is_not_in_the_way(tmp_path, monkeypatch):
  """A save begins where an attempt that never committed left its uncommitted directory,
  while another host's open removes that leftover: found there, then gone before this
  save looked for the mark of a save in it, it was refused as not made by one."""
  path = tmp_path / "ckpt"
  stale = dcp_commit.create_tmp(path)
  pending = races.removed_first(monkeypatch, dcp_commit, "is_ours", stale)  # the other's sweep
  assert dcp_commit.create_tmp(path) == stale and not pending
  assert (stale / dcp_commit.MADE_FILE).is_file()  # made anew, by this save
