"""Who could take a socket's name: the directories on its way, and what is already there."""

import os
import stat

import pytest

from sidecar._src.server import sockets

pytestmark = pytest.mark.unit

ROOT = os.geteuid() == 0


def check(path):
  sockets.check_directories(str(path), what="worker socket", flag="--socket")


@pytest.fixture
def shared(tmp_path):
  """A directory made as a second user would in /tmp: world-writable, not sticky."""
  d = tmp_path / "ww"
  d.mkdir()
  d.chmod(0o777)
  return d


def test_a_directory_others_may_write_is_refused_naming_owner_mode_and_fix(shared):
  with pytest.raises(PermissionError, match=(
      rf"refusing to make the worker socket {shared}/s.sock: the directory {shared} \(owner "
      rf"uid {os.geteuid()}.*, mode 0777\) may be written by any user and is not sticky: "
      r"another user could rename the socket away and listen in its place.*Give --socket a "
      rf"path in a directory of this sidecar's user.*chmod o-w {shared}")):
    check(shared / "s.sock")
  with pytest.raises(PermissionError, match=rf"the directory {shared} \(.*mode 0777"):
    check(shared / "made" / "by" / "the" / "sidecar" / "s.sock")  # above what it would make
  shared.chmod(0o755)
  check(shared / "s.sock")


def test_a_link_through_a_directory_others_may_write_is_refused(shared, tmp_path):
  (tmp_path / "mine").mkdir()
  (shared / "link").symlink_to(tmp_path / "mine")  # the link's name is the others' to swap
  with pytest.raises(PermissionError, match=rf"the directory {shared} "):
    check(shared / "link" / "s.sock")


def test_a_sticky_directory_like_tmp_passes_while_the_name_is_unclaimed(shared):
  shared.chmod(0o1777)
  check(shared / "s.sock")
  os.mknod(shared / "s.sock", stat.S_IFSOCK | 0o600)  # a stale socket of our own: replaced
  check(shared / "s.sock")


@pytest.mark.skipif(not ROOT, reason="giving a file to another user (chown) needs root; this "
                    f"runs as uid {os.geteuid()}")
def test_a_socket_of_another_user_at_the_name_is_refused(shared):
  shared.chmod(0o1777)
  os.mknod(shared / "s.sock", stat.S_IFSOCK | 0o666)
  os.chown(shared / "s.sock", 65534, 65534)
  with pytest.raises(PermissionError, match=(
      rf"refusing to make the worker socket {shared}/s.sock: a socket of another user \(uid "
      rf"65534.*\) already has its name in {shared} \(mode 1777\); it may be an impostor")):
    check(shared / "s.sock")


@pytest.mark.skipif(not ROOT, reason="giving a directory to another user (chown) needs root; "
                    f"this runs as uid {os.geteuid()}")
def test_a_directory_of_another_user_is_refused(tmp_path):
  theirs = tmp_path / "theirs"
  theirs.mkdir(mode=0o755)
  os.chown(theirs, 65534, 65534)
  with pytest.raises(PermissionError, match=(
      rf"the directory {theirs} \(owner uid 65534.*, mode 0755\) belongs to uid 65534.*, not "
      rf"to this sidecar's user \(uid 0.*\): another user could rename the socket away")):
    check(theirs / "s.sock")


def test_a_directory_the_operator_vouches_for_passes_as_tmp_does(shared, monkeypatch):
  monkeypatch.setenv("SIDECAR_SHARED_SOCKET_DIR", str(shared))  # a pod's emptyDir, say
  check(shared / "s.sock")
  monkeypatch.setenv("SIDECAR_SHARED_SOCKET_DIR", str(shared / "other"))
  with pytest.raises(PermissionError, match=rf"the directory {shared} "):
    check(shared / "s.sock")  # only the directory named passes


def test_the_directories_the_sidecar_makes_are_no_others_to_write_whatever_the_umask(tmp_path):
  old = os.umask(0)  # as in a container started with umask 0
  try:
    made = sockets.make_dirs(str(tmp_path / "a" / "b"), what="worker socket", flag="--socket")
  finally:
    os.umask(old)
  assert made == [str(tmp_path / "a" / "b"), str(tmp_path / "a")]
  assert not any(os.stat(d).st_mode & stat.S_IWOTH for d in made)
  check(tmp_path / "a" / "b" / "s.sock")


@pytest.mark.skipif(not ROOT, reason="giving a directory to another group (chown) needs root; "
                    f"this runs as uid {os.geteuid()}")
def test_a_directory_a_group_of_other_users_may_write_is_refused(tmp_path):
  # nogroup holds nobody (its primary group): nobody could rename the socket away.
  theirs = tmp_path / "group"
  theirs.mkdir()
  os.chown(theirs, 0, 65534)
  theirs.chmod(0o770)
  with pytest.raises(PermissionError, match=(
      rf"the directory {theirs} \(owner uid 0.*, mode 0770\) may be written by group 65534, "
      r"which holds other users, and is not sticky.*chmod g-w")):
    check(theirs / "s.sock")
  os.chown(theirs, 0, 0)  # root's group holds root alone: as private as the directory
  check(theirs / "s.sock")
