"""A checkpoint's directory opened once, and what step operations do relative to it
(issue 76, attack 1): no symlink followed below a root, a removal only of the directory
looked at, a rename never over another's, a directory renamed away still acted in."""

import os

import pytest

from sidecar._src.ckptfmt import dir_fd
from sidecar._src.core import beneath, errors

pytestmark = pytest.mark.unit


@pytest.fixture(params=["openat2", "walk"])
def how(request):
  """Each test with the kernel's openat2 and with the walk one component at a time."""
  if request.param == "walk":
    beneath._libc[:] = [None]  # as a kernel without openat2
  yield request.param
  beneath._libc[:] = []


def test_below_follows_no_symlink_at_any_component(tmp_path, how):
  (tmp_path / "a" / "b").mkdir(parents=True)
  (tmp_path / "elsewhere" / "b").mkdir(parents=True)
  with dir_fd.DirFd.below(str(tmp_path), str(tmp_path / "a" / "b")) as d:
    assert d.path == str(tmp_path / "a" / "b") and d.names() == []
  os.rename(tmp_path / "a", tmp_path / "a.real")
  (tmp_path / "a").symlink_to(tmp_path / "elsewhere")  # swapped after its check
  for make in (False, True):
    with pytest.raises(errors.PermissionDeniedError, match=r"a/b'?: a symlink is on the way"):
      dir_fd.DirFd.below(str(tmp_path), str(tmp_path / "a" / "b"), make=make)
  with pytest.raises(ValueError, match="is not under"):
    dir_fd.DirFd.below(str(tmp_path / "a.real"), str(tmp_path / "elsewhere"))


def test_below_makes_what_is_missing_and_refuses_a_file_on_the_way(tmp_path, how):
  with dir_fd.DirFd.below(str(tmp_path), str(tmp_path / "x" / "y"), make=True) as d:
    assert d.identity() == dir_fd.DirFd.at(tmp_path / "x" / "y").identity()
  (tmp_path / "f").write_text("")
  with pytest.raises(NotADirectoryError):
    dir_fd.DirFd.below(str(tmp_path), str(tmp_path / "f" / "y"), make=True)
  root = tmp_path / "root"  # a checkpoint root named before its first save: made too
  with pytest.raises(FileNotFoundError):
    dir_fd.DirFd.below(str(root), str(root / "run"))
  with dir_fd.DirFd.below(str(root), str(root / "run"), make=True) as d:
    assert d.identity() == dir_fd.DirFd.at(root / "run").identity()


def test_acts_stay_in_the_directory_opened_when_its_path_is_swapped(tmp_path):
  (tmp_path / "mine" / "3").mkdir(parents=True)
  (tmp_path / "theirs" / "3").mkdir(parents=True)
  with dir_fd.DirFd.below(str(tmp_path), str(tmp_path / "mine")) as d:
    os.rename(tmp_path / "mine", tmp_path / "moved")
    (tmp_path / "mine").symlink_to(tmp_path / "theirs")  # the path now leads to theirs
    assert d.remove("3")
    d.mkdir("4.tmp")
    d.rename("4.tmp", "4")
  assert os.listdir(tmp_path / "theirs") == ["3"]
  assert os.listdir(tmp_path / "moved") == ["4"]


def test_remove_takes_only_a_directory_and_only_the_one_looked_at(tmp_path):
  (tmp_path / "d").mkdir()
  (tmp_path / "f").write_text("")
  (tmp_path / "link").symlink_to(tmp_path / "d")
  with dir_fd.DirFd.at(tmp_path) as d:
    assert not d.remove("f") and not d.remove("link") and not d.remove("gone")
    with d.child("d") as looked_at:
      seen = looked_at.identity()
    os.rename(tmp_path / "d", tmp_path / "e")
    (tmp_path / "d").mkdir()  # another directory at its name since the look
    assert not d.remove("d", expect=seen)
    assert d.remove("e", expect=seen)
  assert sorted(os.listdir(tmp_path)) == ["d", "f", "link"]


def test_rename_never_replaces_what_is_there(tmp_path, monkeypatch):
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()  # an empty directory, which a plain rename would replace
  for libc in (dir_fd._libc(), None):  # renameat2's NOREPLACE, and a look then a rename
    monkeypatch.setattr(dir_fd, "_libc", lambda libc=libc: libc)
    with dir_fd.DirFd.at(tmp_path) as d, pytest.raises(FileExistsError, match="b"):
      d.rename("a", "b")
  assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_held_uses_the_callers_directory_or_opens_its_own(tmp_path):
  with dir_fd.DirFd.at(tmp_path) as d:
    with dir_fd.held(d, tmp_path) as same:
      assert same is d
    with pytest.raises(ValueError, match="is not the directory"), \
        dir_fd.held(d, tmp_path / "x"):
      pass
    assert d.fd >= 0  # the caller's stays open
  with dir_fd.held(None, tmp_path / "made", make=True) as own:
    assert own.path == str(tmp_path / "made")
  assert own.fd == -1 and (tmp_path / "made").is_dir()
  with pytest.raises(ValueError, match="is not one name"):
    dir_fd.DirFd.at(tmp_path).remove("a/b")
