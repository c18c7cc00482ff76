"""A DCP commit over a committed checkpoint (issue 35 item 4): one atomic swap where the
file system has one (``renameat2``'s exchange), and where it has none, two renames whose
cut-short state the next open or save recovers, never deleting the only complete copy."""

import os

import pytest

from sidecar._src.ckptfmt.dcp import distcp

pytestmark = pytest.mark.unit

META = b"\x80\x04N."  # a pickle's first bytes: finalize checks only those


class Killed(Exception):
  pass


def commit(path, tag, **kw):
  tmp = distcp.create_tmp(path)
  (tmp / "tag").write_text(tag)
  return distcp.finalize(tmp, metadata=META, file_sizes={}, **kw)


def test_an_overwrite_swaps_in_one_step_and_leaves_only_the_new_copy(tmp_path):
  path = tmp_path / "ckpt"
  commit(path, "old")
  seen = []
  commit(path, "new", swapping=lambda: seen.append(sorted(os.listdir(tmp_path))))
  # At the swap's point both copies are whole: the new at the path, the old at the tmp name.
  assert seen == [["ckpt", "ckpt" + distcp.TMP_SUFFIX]]
  assert (path / "tag").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_without_an_exchange_a_cut_overwrite_is_recovered_not_deleted(tmp_path, monkeypatch):
  monkeypatch.setattr(distcp, "_exchange", lambda a, b: False)
  path = tmp_path / "ckpt"
  commit(path, "old")

  def die():
    raise Killed
  with pytest.raises(Killed):  # between the two renames: nothing at the path
    commit(path, "new", swapping=die)
  assert not path.exists() and distcp.is_checkpoint(distcp.old_path(path))
  assert distcp.recover(path) and (path / "tag").read_text() == "old"
  assert not distcp.recover(path)  # nothing more to recover
  with pytest.raises(Killed):
    commit(path, "new", swapping=die)
  commit(path, "newer")  # the next save puts the old copy back first, then replaces it
  assert (path / "tag").read_text() == "newer" and sorted(os.listdir(tmp_path)) == ["ckpt"]
