"""Where the health port's own Unix socket goes (``ports/health_port.inner_dir``): a private
directory in the temp directory, else beside the worker socket. A pod whose root
filesystem is read-only and whose /tmp is not the sidecar's to write (the image test's
podman pod) failed at start: "No usable temporary directory found"."""

import os
import shutil
import stat
import tempfile

import pytest

from sidecar._src.server.ports import health_port

pytestmark = pytest.mark.unit


def test_it_is_a_private_directory_in_the_temp_directory(tmp_path, monkeypatch):
  short = tempfile.mkdtemp(prefix="hp-", dir="/tmp")  # short enough for a socket's path
  try:
    monkeypatch.setattr(tempfile, "tempdir", short)
    made = health_port.inner_dir(str(tmp_path / "sockets"))
    assert os.path.dirname(made) == short
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    health_port.remove_inner_dir(made)
    assert not os.path.exists(made)
  finally:
    os.rmdir(short)


def test_without_a_usable_temp_directory_it_goes_beside_the_worker_socket(tmp_path,
                                                                         monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "none"))  # no such directory
  (tmp_path / "sockets").mkdir()
  made = health_port.inner_dir(str(tmp_path / "sockets"))
  assert os.path.dirname(made) == str(tmp_path / "sockets")
  assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
  health_port.remove_inner_dir(made)


def test_with_neither_it_says_what_to_mount(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "none"))
  with pytest.raises(FileNotFoundError, match=r"needs a writable directory: .*"
                     r"sockets \(the worker socket's directory\): No such file or directory; "
                     r"mount a writable volume at /tmp"):
    health_port.inner_dir(str(tmp_path / "sockets"))


def test_the_sweep_leaves_what_is_gone_or_young_and_removes_a_killed_ones(tmp_path,
                                                                         monkeypatch):
  """Two sidecars starting at once (CI: two test workers): one's sweep met the other's
  directory, removed at its stop between the glob and the stat, and the start failed with
  FileNotFoundError. An entry that is gone (here a link to nothing), a socket not listened
  on that is younger than STALE_S (another's between its bind and its listen) and a link
  are left; an old socket nobody listens on (a killed sidecar's) goes."""
  import socket
  import time
  short = tempfile.mkdtemp(prefix="hp-", dir="/tmp")
  try:
    monkeypatch.setattr(tempfile, "tempdir", short)
    os.symlink(os.path.join(short, "nothing"), os.path.join(short, health_port.INNER_PREFIX
                                                            + "gone"))
    young, killed = (tempfile.mkdtemp(prefix=health_port.INNER_PREFIX, dir=short)
                     for _ in range(2))
    for d in (young, killed):
      with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(os.path.join(d, health_port.INNER_NAME))  # bound, never listened on
    old = time.time() - 2 * health_port.STALE_S
    os.utime(os.path.join(killed, health_port.INNER_NAME), (old, old))
    made = health_port.inner_dir()
    assert os.path.exists(os.path.join(young, health_port.INNER_NAME))
    assert not os.path.exists(killed)
    assert os.path.islink(os.path.join(short, health_port.INNER_PREFIX + "gone"))
    health_port.remove_inner_dir(made)
  finally:
    shutil.rmtree(short)
