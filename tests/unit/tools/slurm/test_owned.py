"""owned.py: ``sidecar slurm`` takes only a new or empty directory, or its own, and removes
only what it wrote there (issue 35 item 3), on real files."""

import os

import pytest

from sidecar._src.core import errors
from sidecar._src.tools.slurm import owned

pytestmark = pytest.mark.unit

ENTRIES = ("token", "hosts")


def fill(directory):
  (directory / "token").write_text("t\n")
  (directory / "hosts").mkdir()
  (directory / "hosts" / "0.json").write_text("{}")


def test_a_directory_it_makes_goes_whole_and_a_requeued_run_clears_only_its_entries(tmp_path):
  d = tmp_path / "a" / "b" / "job"
  owned.claim(str(d), "job 7", ENTRIES, what="test")
  assert oct(d.stat().st_mode & 0o777) == "0o700"
  fill(d)
  owned.claim(str(d), "job 7", ENTRIES, what="test")  # the same job again: cleared
  assert sorted(os.listdir(d)) == [owned.MARKER]
  fill(d)
  assert owned.release(str(d), "job 8", ENTRIES) is False  # not its holder: untouched
  assert sorted(os.listdir(d)) == [owned.MARKER, "hosts", "token"]
  assert owned.release(str(d), "job 7", ENTRIES) is True
  assert not d.exists() and (tmp_path / "a" / "b").is_dir()


def test_an_empty_directory_of_the_users_is_used_and_left_and_a_stray_file_kept(tmp_path):
  d = tmp_path / "rdv"
  d.mkdir(mode=0o755)
  owned.claim(str(d), "job 7", ENTRIES, what="SIDECAR_SLURM_DIR")
  fill(d)
  assert owned.release(str(d), "job 7", ENTRIES) is False
  assert d.is_dir() and os.listdir(d) == []
  assert oct(d.stat().st_mode & 0o777) == "0o755"
  # One it made, with someone's file put inside meanwhile: the file and the directory stay.
  mine = tmp_path / "made"
  owned.claim(str(mine), "job 7", ENTRIES, what="test")
  (mine / "theirs.txt").write_text("x")
  assert owned.release(str(mine), "job 7", ENTRIES) is False
  assert os.listdir(mine) == ["theirs.txt"]


def test_what_is_not_its_own_is_refused_naming_the_path_and_left(tmp_path):
  d = tmp_path / "rdv"
  d.mkdir()
  (d / "notes.txt").write_text("mine")
  with pytest.raises(errors.InvalidArgumentError,
                     match=f"{d} \\(SIDECAR_SLURM_DIR\\) is not empty \\(notes.txt\\)"):
    owned.claim(str(d), "job 7", ENTRIES, what="SIDECAR_SLURM_DIR")
  assert os.listdir(d) == ["notes.txt"]
  other = tmp_path / "other"
  owned.claim(str(other), "job 7", ENTRIES, what="test")
  with pytest.raises(errors.InvalidArgumentError,
                     match="holds the files of sidecar slurm job 7; left as it is"):
    owned.claim(str(other), "service lab", ENTRIES, what="--name lab")
  a_file = tmp_path / "f"
  a_file.write_text("")
  with pytest.raises(errors.InvalidArgumentError, match="exists and is not a plain directory"):
    owned.claim(str(a_file), "job 7", ENTRIES, what="test")
  link = tmp_path / "link"
  link.symlink_to(tmp_path / "empty")
  (tmp_path / "empty").mkdir()
  with pytest.raises(errors.InvalidArgumentError, match="exists and is not a plain directory"):
    owned.claim(str(link), "job 7", ENTRIES, what="test")
