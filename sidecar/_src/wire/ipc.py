"""Framed JSON messages over a Unix socket, with file descriptors alongside.

The worker <-> sidecar control channel: the arena fd is handed over once with
SCM_RIGHTS, then small messages (allocate, free) follow. JSON, never pickle.
The connection itself is the worker's lease: when it closes, however the worker
died, the sidecar frees every block the worker held.

Every client that dials a sidecar's Unix socket (the worker socket, a ``unix:`` gRPC
address) first asks the kernel who serves it (``SO_PEERCRED``) and sends nothing, no
token, no session, to a process of a user it does not trust: :func:`check_server`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pwd
import socket
import struct
import tempfile
from collections.abc import Callable
from typing import Any

from sidecar._src.core import address as address_lib, env as env_lib, errors

_HEADER = struct.Struct("<I")
MAX_MESSAGE = 1 << 20
# Blocks one alloc request on the worker socket may ask for: its reply stays well under
# MAX_MESSAGE.
MAX_ALLOC_BLOCKS = 8192
SOCKET_PATH_MAX = address_lib.SOCKET_PATH_MAX
_SOCKET_NAME_MAX = 16  # what socket_dir leaves for a socket's name in it, with the slash


def socket_dir(prefix: str) -> str:
  """A new private directory for Unix sockets (``prefix`` starts its name): in the temp
  directory, unless sockets there could pass SOCKET_PATH_MAX (a long TMPDIR), then /tmp."""
  directory = tempfile.mkdtemp(prefix=prefix)
  if len(os.fsencode(directory)) + _SOCKET_NAME_MAX <= SOCKET_PATH_MAX:
    return directory
  os.rmdir(directory)
  return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def check_socket_path(path: str, *, fix: str) -> None:
  """Raises OSError (ENAMETOOLONG) naming ``path``, its length and ``fix`` where a Unix
  socket cannot bind to it (Python's own error names neither)."""
  if (n := len(os.fsencode(path))) > SOCKET_PATH_MAX:
    raise OSError(errno.ENAMETOOLONG, f"cannot make the Unix socket {path}: its path is {n} "
                  f"bytes, a Unix socket's may be at most {SOCKET_PATH_MAX}; {fix}")


@dataclasses.dataclass(frozen=True, slots=True)
class Ucred:
  """The process at the other end of a Unix socket connection, as the kernel says
  (``SO_PEERCRED``: the one that listens, seen from a client)."""
  pid: int
  uid: int
  gid: int

  def __str__(self) -> str:
    try:
      name = f" ({pwd.getpwuid(self.uid).pw_name})"
    except KeyError:
      name = ""
    return f"uid {self.uid}{name}, pid {self.pid}"


def ucred_of(sock: socket.socket) -> Ucred:
  """Who is at the other end of the connected Unix socket ``sock``: the one place the
  kernel is asked (``SO_PEERCRED``).

  Raises:
    OSError: ``sock`` is no connected Unix socket.
  """
  pid, uid, gid = struct.unpack(
      "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
  return Ucred(pid, uid, gid)


# Above any pid a Linux kernel gives (PID_MAX_LIMIT, the most /proc/sys/kernel/pid_max takes).
PID_LIMIT = 1 << 22


def pid_namespace() -> str:
  """This process's PID namespace (``pid:[N]``), "" where /proc does not say: a pid names
  the same process only in the same namespace, on the same boot."""
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return ""


def ucred_or_none(sock: socket.socket) -> Ucred | None:
  """:func:`ucred_of`, or None where the kernel does not say (the socket is gone)."""
  try:
    return ucred_of(sock)
  except OSError:
    return None


def trusted_uids() -> frozenset[int]:
  """The users whose Unix sockets a client sends its token to: its own, root's, and those
  ``$SIDECAR_SOCKET_UID`` names."""
  return frozenset({os.getuid(), 0}) | env_lib.socket_uids()


def check_server(sock: socket.socket, path: str) -> Ucred:
  """Returns who serves the Unix socket ``path`` that ``sock`` is connected to, if this
  process may trust it: the same user, root, or one ``$SIDECAR_SOCKET_UID`` names.

  Another user's process there may have taken the socket's name (renamed the sidecar's
  away, or bound it before the sidecar started): nothing may be sent to it.

  Raises:
    PermissionDeniedError: naming the path, the serving uid, user name and pid, and the fix.
  """
  server = ucred_of(sock)
  check_trusted(server, path)
  return server


def check_trusted(server: Ucred, path: str) -> None:
  """:func:`check_server`'s decision: PermissionDeniedError unless ``server``, serving the
  Unix socket ``path``, runs as a user in :func:`trusted_uids`."""
  if server.uid in trusted_uids():
    return
  raise errors.PermissionDeniedError(
      f"refusing to talk to the Unix socket {path}: it is served by {server}, not by this "
      f"process's user (uid {os.getuid()}) or root, so no token or session is sent to it. "
      f"Another user may have taken the socket's name (is its directory "
      f"{os.path.dirname(path) or '.'} one others may write?): stop that process and restart "
      f"the sidecar in a directory of its own; or, if the sidecar runs as that user on "
      f"purpose, set {env_lib.SOCKET_UID}={server.uid} in this process's environment")


def connect(path: str, *, timeout: float | None) -> socket.socket:
  """A stream connection to the Unix socket ``path``, checked with :func:`check_server`
  before anything is sent on it (the worker socket's attach, calls and streams).

  Raises:
    OSError: the connection failed (no socket there, refused, timed out).
    PermissionDeniedError: an untrusted user's process serves it (the socket is closed).
  """
  sock = _dial(path, timeout)
  try:
    check_server(sock, path)
  except BaseException:
    sock.close()
    raise
  return sock


def _dial(target: str, timeout: float | None) -> socket.socket:
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.settimeout(timeout)  # a stopped sidecar's full backlog must not hang connect()
  try:
    sock.connect(target)
  except BaseException:
    sock.close()
    raise
  return sock


class Pinned:
  """A ``unix:`` gRPC address pinned to the very socket whose server was checked.

  The socket file is held open (``O_PATH``) and gRPC dials :attr:`target`,
  ``unix:/proc/self/fd/N``, which reaches that socket however its name is renamed or
  taken later: every reconnect of the channel goes to the process :func:`check_server`
  trusted, or fails (that process is gone), never to whoever listens at the path now.
  Close it (or use it as a context manager) when its channel is closed.

  Raises:
    OSError: no socket at ``path`` (FileNotFoundError), or nothing listens on it.
    PermissionDeniedError: an untrusted user's process serves it.
  """

  def __init__(self, path: str, *, timeout: float | None):
    self.path = path
    o_path = getattr(os, "O_PATH", None)  # Linux's
    if o_path is None:
      os.stat(path)  # FileNotFoundError, as below
    self._fd = -1 if o_path is None else os.open(path, o_path | os.O_CLOEXEC)
    try:
      pinned = f"/proc/self/fd/{self._fd}"
      if self._fd < 0 or not os.path.exists(pinned):  # no /proc: the path, checked once
        pinned = path
      with _dial(pinned, timeout) as probe:
        self.server = check_server(probe, path)
    except BaseException:
      self.close()
      raise
    self.target = f"{address_lib.UNIX}{pinned}"

  def client_ids_name(self) -> bytes | None:
    """The abstract socket beside the pinned one that tells this process its ticket
    (:func:`fetch_ticket`); None where the socket file is gone."""
    try:
      info = os.fstat(self._fd) if self._fd >= 0 else os.stat(self.path)
    except OSError:
      return None
    return client_ids_name(info.st_dev, info.st_ino)

  def close(self) -> None:
    """Lets go of the socket file; idempotent."""
    fd, self._fd = self._fd, -1
    if fd >= 0:
      os.close(fd)

  def __enter__(self) -> Pinned:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


MAX_TICKET = 128  # bytes of a client-id ticket (server/client_ids.py)


def client_ids_name(st_dev: int, st_ino: int) -> bytes:
  """The abstract socket name beside the ``unix:`` gRPC socket file (``st_dev``,
  ``st_ino``) where the sidecar tells each connecting process its ticket."""
  return f"\0sidecar-client-ids-{st_dev}-{st_ino}".encode()


def fetch_ticket(pin: Pinned, *, timeout: float) -> str | None:
  """This process's ticket (``server/client_ids.py``) from the sidecar serving the pinned
  ``unix:`` socket ``pin``: the ticket socket's server must be the very process ``pin``
  checked. None where it tells none (an older sidecar, another network namespace, the
  name taken by someone else): the handshake then counts with other Unix clients'."""
  name = pin.client_ids_name()
  if name is None:
    return None
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.settimeout(min(timeout, 5.0))
  try:
    sock.connect(name)
    if ucred_of(sock).pid != pin.server.pid:
      return None  # not the sidecar pin checked: tell it nothing, take nothing
    data = b""
    while len(data) <= MAX_TICKET and (piece := sock.recv(MAX_TICKET + 1)):
      data += piece
    return data.decode("ascii") if 0 < len(data) <= MAX_TICKET else None
  except (OSError, UnicodeDecodeError):
    return None
  finally:
    sock.close()


# A channel of its own for each pinned target: fd numbers are reused once closed, and
# gRPC's shared subchannels are keyed by target.
PINNED_CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)

Options = tuple[tuple[str, Any], ...]


def pin_channel(address: str, options: Options, *, timeout: float | None,
                unreachable: Callable[[OSError], errors.SidecarError]
                ) -> tuple[Pinned | None, str, Options]:
  """The gRPC target and channel options for ``address``, and for a ``unix:`` one the
  :class:`Pinned` socket they dial (close it after the channel): a TCP address as it is.

  Raises:
    PermissionDeniedError: an untrusted user's process serves the socket.
    SidecarError: ``unreachable(e)``, where nothing serves at the path (``e``, the OSError).
  """
  if not address_lib.is_unix(address):
    return None, address, options
  try:
    pin = Pinned(address_lib.parse(address).path, timeout=timeout)
  except errors.SidecarError:
    raise
  except OSError as e:
    raise unreachable(e) from None
  return pin, pin.target, options + PINNED_CHANNEL_OPTIONS


def send_bytes(sock: socket.socket, data: bytes) -> None:
  """Sends one frame of raw bytes (a serialized protobuf, on stream connections)."""
  sock.sendall(_HEADER.pack(len(data)) + data)


def recv_bytes(sock: socket.socket, *, limit: int = MAX_MESSAGE) -> bytes:
  (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
  if length > limit:
    raise errors.InvalidArgumentError(f"frame of {length} bytes exceeds the limit of {limit}")
  return _recv_exact(sock, length)


class FrameReader:
  """Reads frames through a buffer: one ``recv`` can bring several small frames (or a
  frame's header and body at once)."""

  def __init__(self, sock: socket.socket, *, limit: int = MAX_MESSAGE):
    self._sock = sock
    self._limit = limit
    self._buf = bytearray()
    self._pos = 0

  def _fill(self, n: int, flags: int = 0) -> None:
    while len(self._buf) - self._pos < n:
      if self._pos:
        del self._buf[:self._pos]
        self._pos = 0
      chunk = self._sock.recv(max(65536, n - len(self._buf)), flags)
      if not chunk:
        raise ConnectionError("the peer closed the socket")
      self._buf += chunk

  def buffered(self) -> int:
    """Bytes received and not yet read as frames."""
    return len(self._buf) - self._pos

  def read(self, *, wait: bool = True) -> bytes:
    """The next frame. ``wait`` False: BlockingIOError unless a whole frame is there
    already (what came of one stays buffered), with no system call beyond the ``recv``
    (no switch of the socket's mode); the socket must then have no timeout (a timeout
    waits before a ``recv``, whatever its flags)."""
    flags = 0 if wait else socket.MSG_DONTWAIT
    self._fill(_HEADER.size, flags)
    (length,) = _HEADER.unpack_from(self._buf, self._pos)
    if length > self._limit:
      raise errors.InvalidArgumentError(
          f"frame of {length} bytes exceeds the limit of {self._limit}")
    self._fill(_HEADER.size + length, flags)
    start = self._pos + _HEADER.size
    self._pos = start + length
    return bytes(self._buf[start:self._pos])


def send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
  data = json.dumps(message, separators=(",", ":")).encode()
  frame = _HEADER.pack(len(data)) + data
  if fds:
    sent = socket.send_fds(sock, [frame], list(fds))
    if sent < len(frame):
      sock.sendall(frame[sent:])
  else:
    sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  data = sock.recv(n)
  if len(data) == n:
    return data
  buf = bytearray(data)
  while len(buf) < n:
    chunk = sock.recv(n - len(buf))
    if not chunk:
      raise ConnectionError("the peer closed the socket")
    buf += chunk
  return bytes(buf)


def recv(sock: socket.socket, *, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
  """Reads one message (and up to ``max_fds`` descriptors sent with it)."""
  fds: list[int] = []
  if max_fds:
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
    if not head:
      raise ConnectionError("the peer closed the socket")
    if len(head) < _HEADER.size:
      head += _recv_exact(sock, _HEADER.size - len(head))
  else:
    head = _recv_exact(sock, _HEADER.size)
  (length,) = _HEADER.unpack(head)
  if length > MAX_MESSAGE:
    raise errors.InvalidArgumentError(f"control message of {length} bytes exceeds {MAX_MESSAGE}")
  return message_of(_recv_exact(sock, length)), fds


def message_of(data: bytes) -> dict[str, Any]:
  """The control message (a JSON object) one frame holds, checked."""
  try:
    message = json.loads(data)
  except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep
    raise errors.InvalidArgumentError(
        f"malformed control message: {type(e).__name__}: {e}"[:300]) from None
  if not isinstance(message, dict):
    raise errors.InvalidArgumentError(f"control message must be an object, got {message!r:.80}")
  return message
