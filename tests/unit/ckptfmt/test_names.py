"""Names, not paths (issue 42): what a client may call a file, and opening it beneath its
directory without following a symlink."""

import os

import numpy as np
import pytest

from sidecar._src.ckptfmt import direct_io, names
from sidecar._src.core import errors

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("value", "why"), [
    ("/etc/passwd", "not an absolute path"), ("..", "'..' component"),
    ("a/../../b", "'..' component"), ("a//b", "empty"), (".", "empty, '.' or"),
    ("a\0b", "no NUL"), ("", "a non-empty string"), (7, "a non-empty string"),
    ("x" * 256, "each component at most 255 bytes"), ("a/" * 2049, "at most 4096 bytes")],
    ids=["absolute", "dotdot", "dotdot-inside", "empty-part", "dot", "nul", "empty", "int",
         "long-part", "long"])
def test_what_is_no_name_is_refused_naming_the_field_and_the_fix(value, why):
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"leaf must be a name relative to its checkpoint directory "
                     rf"\(.*{why}.*\), got .*; the fix"):
    names.check_name(value, "leaf", fix="the fix")


@pytest.mark.parametrize("value", ["w", "opt.0.mu", "a/b", "a..b", "..a", ".hidden"])
def test_names(value):
  assert names.check_name(value, "leaf") == value


def test_a_file_opens_beneath_its_directory_and_never_through_a_symlink(tmp_path):
  base, outside = tmp_path / "base", tmp_path / "outside"
  base.mkdir()
  outside.mkdir()
  fd = names.open_beneath(base, "a/b/c", os.O_WRONLY | os.O_CREAT, make_dirs=True)
  os.close(fd)
  assert (base / "a" / "b" / "c").is_file()
  (base / "link").symlink_to(outside)  # a directory swapped for a symlink
  (base / "file").symlink_to(outside / "f")
  for name in ("link/x", "file"):
    with pytest.raises(OSError) as info:
      os.close(names.open_beneath(base, name, os.O_WRONLY | os.O_CREAT, make_dirs=True))
    assert str(base / name) in str(info.value)
  assert list(outside.iterdir()) == []
  with pytest.raises(errors.InvalidArgumentError):
    names.open_beneath(base, "../outside/x", os.O_WRONLY | os.O_CREAT)
  with pytest.raises(errors.PermissionDeniedError, match="outside its checkpoint directory"):
    names.check_beneath(base, base / "link" / "x", "leaf")
  assert names.check_beneath(base, base / "a" / "b", "leaf") == base / "a" / "b"


def _swap_for_symlink(directory, target):
  """``directory`` (empty) swapped for a symlink to ``target``, as another user could where
  its parent is writable by others."""
  directory.rmdir()
  directory.symlink_to(target)


def test_the_base_directory_is_reached_without_following_a_symlink_others_could_swap(tmp_path):
  """Issue 42's gap (a): the base directory was opened by its path, following symlinks: a
  component swapped for a symlink after the server checked the directory redirected the
  write. Now it is reached from ``/`` with ``O_NOFOLLOW``; a symlink in a directory others
  may write (no sticky bit) is refused, naming it, and nothing lands outside."""
  shared, outside = tmp_path / "shared", tmp_path / "outside"
  shared.mkdir()
  outside.mkdir()
  shared.chmod(0o777)  # anyone may rename entries here
  base = shared / "ck"
  base.mkdir()
  os.close(names.open_beneath(base, "a/x", os.O_WRONLY | os.O_CREAT, make_dirs=True))
  (base / "a" / "x").unlink()
  (base / "a").rmdir()
  _swap_for_symlink(base, outside)  # after the check: the same path, elsewhere
  for make_dirs in (False, True):
    with pytest.raises(errors.PermissionDeniedError,
                       match=rf"refusing to follow the symlink '{shared / 'ck'}' on the way to "
                       rf"the checkpoint directory .*mode 0777.*name the directory by its "
                       "resolved path"):
      names.open_beneath(base, "x", os.O_WRONLY | os.O_CREAT, make_dirs=make_dirs)
  with pytest.raises(errors.PermissionDeniedError, match="refusing to follow the symlink"):
    direct_io.write_file("0.0", np.zeros(8, np.uint8), beneath=base)
  with pytest.raises(errors.PermissionDeniedError, match="refusing to follow the symlink"):
    direct_io.write_small(base / "manifest", b"{}")
  assert list(outside.iterdir()) == []


def test_a_symlink_in_a_sticky_directory_is_followed_only_if_its_owner_is_trusted(tmp_path):
  """In a sticky directory (``/tmp``) only a link's owner may replace it: one of this user's
  (or root's) is followed; one another user owns is refused."""
  sticky, real = tmp_path / "sticky", tmp_path / "real"
  sticky.mkdir()
  real.mkdir()
  sticky.chmod(0o1777)
  link = sticky / "ck"
  link.symlink_to(real)
  os.close(names.open_beneath(link, "x", os.O_WRONLY | os.O_CREAT))
  assert (real / "x").is_file()
  if os.geteuid() != 0:
    pytest.skip("giving the symlink to another user (nobody) takes root")
  os.lchown(link, 65534, 65534)
  with pytest.raises(errors.PermissionDeniedError, match="it belongs to uid 65534"):
    names.open_beneath(link, "y", os.O_WRONLY | os.O_CREAT)
  assert not (real / "y").exists()


def test_a_symlinked_directory_of_this_user_is_followed_and_names_still_are_not(tmp_path):
  """A checkpoint directory reached through this user's own symlink (a mount point's link)
  works, with or without ``openat2``; a symlink below the base never is followed."""
  real, outside = tmp_path / "real", tmp_path / "outside"
  real.mkdir()
  outside.mkdir()
  (tmp_path / "link").symlink_to("real")  # relative, as `ln -s real link` makes
  (real / "leaf").symlink_to(outside)
  for walk in (False, True):
    if walk:
      names._libc[:] = [None]  # as a kernel without openat2
    try:
      os.close(names.open_beneath(tmp_path / "link", f"f{walk}", os.O_WRONLY | os.O_CREAT))
      assert (real / f"f{walk}").is_file()
      for make_dirs in (False, True):
        with pytest.raises(OSError, match="leaf/x"):
          names.open_beneath(tmp_path / "link", "leaf/x", os.O_WRONLY | os.O_CREAT,
                             make_dirs=make_dirs)
    finally:
      names._libc[:] = []
  assert list(outside.iterdir()) == []
