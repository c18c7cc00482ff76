"""Framed JSON messages over a Unix socket, with file descriptors alongside.

The worker <-> sidecar control channel: the arena fd is handed over once with
SCM_RIGHTS, then small messages (allocate, free) follow. JSON, never pickle.
The connection itself is the worker's lease: when it closes, however the worker
died, the sidecar frees every block the worker held.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import tempfile
from typing import Any

from sidecar._src.core import address as address_lib, errors

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


def send_bytes(sock: socket.socket, data: bytes) -> None:
  """Sends one frame of raw bytes (a serialized protobuf, on stream connections)."""
  sock.sendall(_HEADER.pack(len(data)) + data)


def recv_bytes(sock: socket.socket, *, limit: int = MAX_MESSAGE) -> bytes:
  (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
  if length > limit:
    raise errors.InvalidArgumentError(f"frame of {length} bytes exceeds the limit of {limit}")
  return _recv_exact(sock, length)


class FrameReader:
  """Reads frames through a buffer: one ``recv`` can bring several small frames."""

  def __init__(self, sock: socket.socket, *, limit: int = MAX_MESSAGE):
    self._sock = sock
    self._limit = limit
    self._buf = bytearray()
    self._pos = 0

  def _fill(self, n: int) -> None:
    while len(self._buf) - self._pos < n:
      if self._pos:
        del self._buf[:self._pos]
        self._pos = 0
      chunk = self._sock.recv(max(65536, n - len(self._buf)))
      if not chunk:
        raise ConnectionError("the peer closed the socket")
      self._buf += chunk

  def buffered(self) -> int:
    """Bytes received and not yet read as frames."""
    return len(self._buf) - self._pos

  def read(self) -> bytes:
    self._fill(_HEADER.size)
    (length,) = _HEADER.unpack_from(self._buf, self._pos)
    if length > self._limit:
      raise errors.InvalidArgumentError(
          f"frame of {length} bytes exceeds the limit of {self._limit}")
    self._fill(_HEADER.size + length)
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
  try:
    message = json.loads(_recv_exact(sock, length))
  except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep
    raise errors.InvalidArgumentError(
        f"malformed control message: {type(e).__name__}: {e}"[:300]) from None
  if not isinstance(message, dict):
    raise errors.InvalidArgumentError(f"control message must be an object, got {message!r:.80}")
  return message, fds
