import errno
import os
import socket
import tempfile

import pytest

from sidecar._src.core import errors
from sidecar._src.wire import ipc

pytestmark = pytest.mark.unit


def test_frame_reader_reads_frames_that_arrive_together_or_in_pieces():
  a, b = socket.socketpair()
  with a, b:
    for payload in (b"one", b"", b"x" * 100_000):
      ipc.send_bytes(a, payload)
    frame = b"\x05\x00\x00\x00hello"
    a.sendall(frame[:2])  # a header split across sends
    reader = ipc.FrameReader(b)
    assert reader.read() == b"one" and reader.read() == b""
    assert reader.read() == b"x" * 100_000
    a.sendall(frame[2:])
    assert reader.read() == b"hello"
    ipc.send(a, {"op": "free"})
    assert reader.read() == b'{"op":"free"}'


def test_a_frame_reader_that_must_not_wait_keeps_a_part_frame_until_the_rest_comes():
  a, b = socket.socketpair()
  with a, b:
    reader = ipc.FrameReader(b)
    frame = b"\x05\x00\x00\x00hello"
    for part in (b"", frame[:2], frame[2:6]):  # nothing, a part of the header, part of the body
      a.sendall(part)
      with pytest.raises(BlockingIOError):
        reader.read(wait=False)
    a.sendall(frame[6:] + frame)
    assert reader.read(wait=False) == b"hello" and reader.read(wait=False) == b"hello"
    assert b.gettimeout() is None  # no switch of the socket's mode: it still waits
    ipc.send(a, {"seq": 3})
    assert ipc.message_of(reader.read()) == {"seq": 3}
    with pytest.raises(errors.InvalidArgumentError, match="must be an object, got \\[1\\]"):
      ipc.message_of(b"[1]")


def test_frame_reader_limits_and_eof():
  a, b = socket.socketpair()
  with b:
    ipc.send_bytes(a, b"y" * 50)
    reader = ipc.FrameReader(b, limit=10)
    with pytest.raises(errors.InvalidArgumentError,
                       match="frame of 50 bytes exceeds the limit of 10"):
      reader.read()
    a.close()
    with pytest.raises(ConnectionError, match="closed"):
      ipc.FrameReader(b).read()


def test_socket_dirs_leave_room_for_a_socket_under_a_long_temp_dir(tmp_path, monkeypatch):
  long = tmp_path / ("t" * 90)
  long.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(long))
  short = tempfile.mkdtemp(prefix="s", dir="/tmp")
  made = [short]
  try:
    made.append(ipc.socket_dir("sidecar-test-"))  # the temp dir has no room: /tmp
    assert made[-1].startswith("/tmp/sidecar-test-")
    assert len(os.path.join(made[-1], "host99.sock")) <= ipc.SOCKET_PATH_MAX
    assert list(long.iterdir()) == []  # the one it tried first is gone
    monkeypatch.setattr(tempfile, "tempdir", short)
    made.append(ipc.socket_dir("sidecar-test-"))
    assert os.path.dirname(made[-1]) == short
    assert oct(os.stat(made[-1]).st_mode & 0o777) == "0o700"
  finally:
    for d in reversed(made):
      os.rmdir(d)


def test_a_socket_path_too_long_names_its_length_the_limit_and_the_fix():
  path = "/tmp/" + "x" * 103
  ipc.check_socket_path(path[:-1], fix="unused")  # 107 bytes: fits
  with pytest.raises(OSError, match=rf"cannot make the Unix socket {path}: its path is 108 "
                                    r"bytes, a Unix socket's may be at most 107; give a shorter "
                                    r"path") as e:
    ipc.check_socket_path(path, fix="give a shorter path")
  assert e.value.errno == errno.ENAMETOOLONG
  with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError, match="too long"):
    s.bind(path)  # what the limit is for: the kernel refuses it too


def _another_uid() -> int:
  """A uid this process is not, and not root: nobody's where it exists."""
  import pwd
  try:
    uid = pwd.getpwnam("nobody").pw_uid
  except KeyError:
    uid = 65534
  return uid if uid != os.getuid() else uid - 1


def test_a_socket_another_user_serves_is_refused_naming_who_and_the_fix(monkeypatch):
  monkeypatch.delenv("SIDECAR_SOCKET_UID", raising=False)
  uid = _another_uid()
  with pytest.raises(errors.PermissionDeniedError, match=(
      rf"refusing to talk to the Unix socket /tmp/x/g.sock: it is served by uid {uid}.*, pid "
      rf"4242, not by this process's user \(uid {os.getuid()}\) or root, so no token or "
      rf"session is sent to it\. .*its directory /tmp/x.*set SIDECAR_SOCKET_UID={uid}")):
    ipc.check_trusted(ipc.Ucred(pid=4242, uid=uid, gid=uid), "/tmp/x/g.sock")
  ipc.check_trusted(ipc.Ucred(pid=1, uid=os.getuid(), gid=0), "/tmp/x/g.sock")  # the same user
  ipc.check_trusted(ipc.Ucred(pid=1, uid=0, gid=0), "/tmp/x/g.sock")  # root


@pytest.mark.parametrize("named", ["uid", "name"])
def test_socket_uid_names_a_user_the_client_trusts_too(monkeypatch, named):
  import pwd
  uid = _another_uid()
  try:
    value = str(uid) if named == "uid" else pwd.getpwuid(uid).pw_name
  except KeyError:
    pytest.skip(f"uid {uid} has no user name on this machine")
  monkeypatch.setenv("SIDECAR_SOCKET_UID", f"12345, {value}")
  assert ipc.trusted_uids() == {os.getuid(), 0, 12345, uid}
  ipc.check_trusted(ipc.Ucred(pid=4242, uid=uid, gid=uid), "/tmp/x/g.sock")


def test_socket_uid_naming_no_user_is_named(monkeypatch):
  monkeypatch.setenv("SIDECAR_SOCKET_UID", "no-such-user-xyz")
  with pytest.raises(errors.InvalidArgumentError, match=r"SIDECAR_SOCKET_UID='no-such-user-xyz'"
                     r": no such user on this machine"):
    ipc.trusted_uids()


def test_pin_channel_pins_a_unix_address_and_passes_a_tcp_one(tmp_path):
  """The one door of the controller's and the replica link's channels to a ``unix:``
  sidecar (issue 42's review: written twice): the checked socket, or the caller's error."""
  assert ipc.pin_channel("127.0.0.1:5", (("a", 1),), timeout=1, unreachable=None) == (
      None, "127.0.0.1:5", (("a", 1),))
  with pytest.raises(errors.HostLostError, match="gone: "):
    ipc.pin_channel(f"unix:{tmp_path}/none.sock", (), timeout=1,
                    unreachable=lambda e: errors.HostLostError(f"gone: {e}"))
  with socket.socket(socket.AF_UNIX) as listener:
    listener.bind(str(tmp_path / "s.sock"))
    listener.listen(1)
    pin, target, options = ipc.pin_channel(f"unix:{tmp_path}/s.sock", (("a", 1),), timeout=1,
                                           unreachable=None)
    with pin:
      assert target == pin.target and target.startswith("unix:/proc/self/fd/")
      assert options == (("a", 1),) + ipc.PINNED_CHANNEL_OPTIONS
