"""Where the health port's own Unix socket goes (``ports/health_port.inner_dir``): a private
directory in the temp directory, else beside the worker socket. A pod whose root
filesystem is read-only and whose /tmp is not the sidecar's to write (the image test's
podman pod) failed at start: "No usable temporary directory found"."""

import os
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
