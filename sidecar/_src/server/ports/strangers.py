"""The control port's strangers: connections that carried no RPC the sidecar took (a valid
token, or any RPC where none is asked). Each remote keeps at most ``STRANGERS_PER_REMOTE`` of
them, and none stays one longer than the handshake timeout: the sidecar closes the rest.

gRPC bounds the port's connections in total only (``grpc.max_allowed_incoming_connections``:
``max_connections``), and a Python server never sees a connection arrive or learns which
one an RPC came on before its handler runs. So 2,048 idle HTTP/2 connections without a
token held every place, and no client could connect again, 15 s later as at once (issue
76, attack round eight). The kernel knows every connection, so the sidecar asks it:

- ``Admitted``, an interceptor placed after ``credentials.TokenAuth``, records the remote
  (address and port: one TCP connection) of every RPC that reached a handler;
- ``Strangers``, a thread, lists this process's own descriptors (``/proc/self/fd``) every
  ``SCAN_S`` (``BUSY_SCAN_S`` while it finds strangers), takes the TCP sockets accepted
  on the control port, and shuts down (``shutdown(2)``, gRPC then closes its end) the
  strangers past a remote's bound, oldest first, and those older than the grace. A socket is
  acted on only through a duplicate of its descriptor that is still that socket (its
  inode): a descriptor closed and reused since the listing is left alone.

A client with the token is never a stranger for longer than its first RPC takes (a
``Controller`` handshakes at once). What remains: a flood that opens connections again
faster than the scans close them can still fill ``max_connections`` between two scans
(a few thousand a second from one remote, on loopback); docs/security.md says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import logging
import os
import socket
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable

import grpc

log = logging.getLogger(__name__)

STRANGERS_PER_REMOTE = 16
SCAN_S = 1.0
BUSY_SCAN_S = 0.25
_LOG_EVERY_S = 10.0

Endpoint = tuple[str, int]  # an IP address (IPv4 as itself) and a port: one connection


def endpoint(address: str | tuple) -> Endpoint | None:
  """A TCP remote as one ``Endpoint``: gRPC's peer string (``ipv4:1.2.3.4:5``,
  ``ipv6:%5B::1%5D:5``) or a socket address; None for anything else (``unix:``)."""
  if isinstance(address, str):
    kind, _, rest = address.partition(":")
    if kind not in ("ipv4", "ipv6"):
      return None
    host, _, port = urllib.parse.unquote(rest).rpartition(":")
    address = (host.strip("[]"), int(port))
  try:
    ip = ipaddress.ip_address(str(address[0]).split("%")[0])
  except ValueError:
    return None
  return str(getattr(ip, "ipv4_mapped", None) or ip), int(address[1])


class Admitted(grpc.ServerInterceptor):
  """Records the connection of every RPC that reaches its handler (after ``TokenAuth``:
  one whose token passed), when its handler starts."""

  def __init__(self):
    self._lock = threading.Lock()
    self._seen: dict[Endpoint, float] = {}

  def intercept_service(self, continuation, handler_call_details):
    handler = continuation(handler_call_details)
    if handler is None:
      return None
    kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
            else "stream_unary" if handler.stream_unary else "stream_stream")
    behavior = getattr(handler, kind)

    @functools.wraps(behavior)  # grpcio's experimental_* attributes too
    def recorded(request, context, *args, **kwargs):
      self.note(context.peer())
      return behavior(request, context, *args, **kwargs)
    return handler._replace(**{kind: recorded})

  def note(self, remote: str) -> None:
    point = endpoint(remote)
    if point is not None:
      with self._lock:
        self._seen[point] = time.monotonic()

  def admitted(self, point: Endpoint) -> bool:
    with self._lock:
      return point in self._seen

  def forget(self, keep: set[Endpoint], before: float) -> None:
    """Forgets the connections recorded before ``before`` that are not in ``keep``
    (closed since)."""
    with self._lock:
      for point in [p for p, t in self._seen.items() if t < before and p not in keep]:
        del self._seen[point]


@dataclasses.dataclass(slots=True)
class _Conn:
  fd: int
  remote: Endpoint
  since: float  # when a scan first saw it


_OTHER = None  # a socket that is no connection of the port


class Strangers:
  """Closes the port's strangers past their bounds; ``start()``, ``close()`` (joins)."""

  def __init__(self, port: int, admitted: Admitted, *, grace_s: float,
               per_remote: int | None = None, clock: Callable[[], float] = time.monotonic):
    self.port, self.admitted, self.grace_s = port, admitted, grace_s
    self.per_remote = STRANGERS_PER_REMOTE if per_remote is None else per_remote
    self._clock = clock
    self._known: dict[int, _Conn | None] = {}  # by socket inode
    self._stop = threading.Event()
    self._logged = -_LOG_EVERY_S
    self.closed = 0  # strangers closed so far
    self._thread = threading.Thread(target=self._loop, name="sidecar-strangers", daemon=True)

  def start(self) -> Strangers:
    self._thread.start()
    return self

  def close(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(5.0)

  def _loop(self) -> None:
    while not self._stop.is_set():
      try:
        busy = self.scan()
      except Exception:  # a scan that fails is tried again; the port serves meanwhile
        log.exception("control port %d: cannot look over its connections", self.port)
        busy = False
      self._stop.wait(BUSY_SCAN_S if busy else SCAN_S)

  def scan(self) -> bool:
    """One look: closes the strangers past their bounds; whether any stranger is left."""
    began = self._clock()
    conns = self._connections(began)
    self.admitted.forget({c.remote for c in conns.values()}, began)
    strangers = sorted(((ino, c) for ino, c in conns.items()
                        if not self.admitted.admitted(c.remote)),
                       key=lambda item: item[1].since, reverse=True)  # newest first
    by_remote: dict[str, int] = {}
    closed = 0
    for ino, c in strangers:
      by_remote[c.remote[0]] = by_remote.get(c.remote[0], 0) + 1
      if by_remote[c.remote[0]] > self.per_remote or began - c.since >= self.grace_s:
        closed += self._shut(ino, c)
    if closed:
      self.closed += closed
      if began - self._logged >= _LOG_EVERY_S:
        self._logged = began
        log.warning("control port %d: closed %d connections that presented no token (at most "
                    "%d per remote, none for more than %g s); %d closed so far", self.port,
                    closed, self.per_remote, self.grace_s, self.closed)
    return len(strangers) > closed

  def _connections(self, now: float) -> dict[int, _Conn]:
    """The port's accepted TCP connections now, by socket inode."""
    seen: dict[int, _Conn | None] = {}
    for name in os.listdir("/proc/self/fd"):
      try:
        info = os.stat(f"/proc/self/fd/{name}")
      except (OSError, ValueError):
        continue
      if not stat.S_ISSOCK(info.st_mode):
        continue
      ino = info.st_ino
      seen[ino] = (self._known[ino] if ino in self._known
                   else self._identify(int(name), ino, now))
    self._known = seen
    return {ino: c for ino, c in seen.items() if c is not None}

  def _identify(self, fd: int, ino: int, now: float) -> _Conn | None:
    """What socket ``fd`` (inode ``ino``) is: a connection accepted on the port (and its
    remote), or ``_OTHER``."""
    sock = self._dup(fd, ino)
    if sock is None:
      return _OTHER
    try:
      if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return _OTHER
      if sock.getsockname()[1] != self.port:
        return _OTHER
      remote = endpoint(sock.getpeername())  # OSError: the listener itself
      return _OTHER if remote is None else _Conn(fd, remote, now)
    except OSError:
      return _OTHER
    finally:
      sock.close()

  def _shut(self, ino: int, conn: _Conn) -> bool:
    """Shuts connection ``conn`` down, if descriptor ``conn.fd`` is still socket ``ino``."""
    sock = self._dup(conn.fd, ino)
    if sock is None:
      return False
    with contextlib.closing(sock):
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        return False
    return True

  @staticmethod
  def _dup(fd: int, ino: int) -> socket.socket | None:
    """A duplicate of ``fd`` as a socket object, if it is still socket ``ino`` (else None:
    closed, and its number reused since it was listed: not ours to touch)."""
    try:
      dup = os.dup(fd)
    except OSError:
      return None
    try:
      if os.fstat(dup).st_ino == ino:
        return socket.socket(fileno=dup)
    except OSError:
      pass
    os.close(dup)
    return None
