"""The health port, accepted by the sidecar itself: each connection counted by its remote
before gRPC sees a byte of it, then relayed to the health service's own gRPC server on a
private Unix socket.

Why not gRPC's own listener: it bounds connections in total only
(``grpc.max_allowed_incoming_connections``), and a Python server never sees a connection
arrive. So 64 connections holding a ``Watch`` stream each, or 64 idle ones opened again as
they close, kept every health check out, and the kubelet would restart a healthy sidecar
(issue 76, attack round eight). Here:

- per remote (the client's address) at most ``HEALTH_PER_REMOTE`` connections, in all
  ``HEALTH_CONNECTIONS``; past either, a connection gives way by ``remotes.RemoteTable``'s
  rule, so a new remote's probe always gets in, unless ``HEALTH_CONNECTIONS`` different
  remotes hold one each;
- a connection whose client said nothing for ``HEALTH_IDLE_S``, or that is
  ``HEALTH_LIFE_S`` old, is closed (a probe takes milliseconds; the kubelet opens one per
  probe);
- behind it, the health server takes one stream per connection and has a thread per
  connection: a call whose request never comes holds its connection's thread only, never
  another's, and goes with its connection.

The relay is one thread (``sidecar-health-port``), one selector, small buffers: the
health answer is a few dozen bytes.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import ipaddress
import logging
import os
import selectors
import socket
import stat
import tempfile
import threading
import time

from sidecar._src.server.ports import remotes
from sidecar._src.wire import ipc

log = logging.getLogger(__name__)

HEALTH_CONNECTIONS = 64
HEALTH_PER_REMOTE = 8
# The inner gRPC server's own bound: room for the connections it has not seen closed yet.
INNER_CONNECTIONS = 4 * HEALTH_CONNECTIONS
HEALTH_IDLE_S = 10.0
HEALTH_LIFE_S = 60.0
_BUFFER = 64 << 10  # bytes buffered each way per connection
_BACKLOG = 128
_ACCEPT_RETRY_S = 0.1  # an accept that failed for want of descriptors is tried again after
_LOG_EVERY_S = 10.0
_R, _W = selectors.EVENT_READ, selectors.EVENT_WRITE


INNER_PREFIX = "sidecar-health-"
INNER_NAME = "health.sock"
# A socket younger than this is never swept: another sidecar may be between its bind and its
# listen (a connect is refused then too); a killed one's is removed at a later start.
STALE_S = 60.0


def inner_dir(beside: str | None = None) -> str:
  """A new private directory (0700) for the health server's own Unix socket: in the temp
  directory, else (none usable: a read-only root filesystem without a /tmp volume) in
  ``beside``, the worker socket's directory, which the sidecar writes in anyway. First
  removes those a killed sidecar of this user left (their socket served by nobody).

  Raises:
    FileNotFoundError: neither is writable, naming both and the fix.
  """
  try:
    made = ipc.socket_dir(INNER_PREFIX)
  except FileNotFoundError as e:  # tempfile's "No usable temporary directory found"
    if beside is None:
      raise
    try:
      made = tempfile.mkdtemp(prefix=INNER_PREFIX, dir=beside)
    except OSError as e2:
      raise FileNotFoundError(
          f"the health port's own Unix socket needs a writable directory: {e}; and "
          f"{beside} (the worker socket's directory): {e2.strerror or e2}; mount a "
          "writable volume at /tmp (on Kubernetes, an emptyDir) or set TMPDIR") from None
  for d in glob.glob(os.path.join(os.path.dirname(made), INNER_PREFIX + "*")):
    path = os.path.join(d, INNER_NAME)
    try:
      entry, sock = os.lstat(d), os.lstat(path)
    except OSError:  # gone since the glob (another sidecar stopped), or no socket in it yet
      continue
    if (d == made or not stat.S_ISDIR(entry.st_mode) or entry.st_uid != os.geteuid()
        or time.time() - sock.st_mtime < STALE_S):  # another's, maybe bound, not listening yet
      continue
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
      if probe.connect_ex(path) == errno.ECONNREFUSED:  # nobody listens: left by a kill
        with contextlib.suppress(OSError):
          os.unlink(path)
          os.rmdir(d)
  return made


def remove_inner_dir(directory: str) -> None:
  """Removes ``inner_dir``'s directory and its socket (at stop)."""
  with contextlib.suppress(OSError):
    os.unlink(os.path.join(directory, INNER_NAME))
  with contextlib.suppress(OSError):
    os.rmdir(directory)


def remote_of(address: tuple) -> str:
  """A client's address as one remote: an IPv4 client of a dual-stack socket is its IPv4."""
  ip = ipaddress.ip_address(address[0].split("%")[0])
  mapped = getattr(ip, "ipv4_mapped", None)
  return str(mapped or ip)


def listeners(host: str, port: int, flag: str) -> list[socket.socket]:
  """Listening sockets for ``host`` (as ``--listen`` gives it) and ``port`` (0: a free
  one): a wildcard is one dual-stack socket, a name every address it resolves to.

  Raises:
    OSError: the address cannot be listened on, naming it and ``flag``.
  """
  host = host.strip("[]")
  out: list[socket.socket] = []
  try:
    if host in ("", "::", "0.0.0.0"):
      dual = socket.has_dualstack_ipv6()
      out.append(socket.create_server(("::" if dual else "0.0.0.0", port), backlog=_BACKLOG,
                                      family=socket.AF_INET6 if dual else socket.AF_INET,
                                      dualstack_ipv6=dual))
      return out
    for family, _, _, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE):
      if out:  # the port the first one took
        address = (address[0], out[0].getsockname()[1], *address[2:])
      out.append(socket.create_server(address, family=family, backlog=_BACKLOG))
    return out
  except OSError as e:
    for s in out:
      s.close()
    raise OSError(e.errno, f"cannot listen on {host}:{port} ({e.strerror or e}); pick "
                  f"another {flag}") from None


class _Link:
  """One client connection and its relay to the health server."""
  __slots__ = ("remote", "client", "inner", "up", "down", "opened", "heard", "inner_done")

  def __init__(self, remote: str, client: socket.socket, inner: socket.socket, now: float):
    self.remote, self.client, self.inner = remote, client, inner
    self.up, self.down = bytearray(), bytearray()  # to the server, to the client
    self.opened = self.heard = now
    self.inner_done = False  # the server closed its end: the rest goes, then the link


class HealthPort:
  """Listens on ``host``:``port`` and relays each connection it keeps to the gRPC server
  on the Unix socket ``inner``. ``start()``, then ``close()`` (idempotent, joins)."""

  def __init__(self, host: str, port: int, inner: str, *, flag: str = "--health-port",
               bounds: remotes.Bounds | None = None, idle_s: float | None = None,
               life_s: float | None = None):
    self.inner = inner
    self.idle_s = HEALTH_IDLE_S if idle_s is None else idle_s
    self.life_s = HEALTH_LIFE_S if life_s is None else life_s
    self.remotes = remotes.RemoteTable(bounds or remotes.Bounds(per_remote=HEALTH_PER_REMOTE,
                                                        total=HEALTH_CONNECTIONS))
    self._listeners = listeners(host, port, flag)
    self.port = self._listeners[0].getsockname()[1]
    self._selector = selectors.DefaultSelector()
    self._wake_r, self._wake_w = socket.socketpair()
    self._links: dict[int, _Link] = {}  # by the client socket's fd
    self._stop = threading.Event()
    self._paused_until = 0.0  # accepting waits out EMFILE and the like until then
    self._logged = -_LOG_EVERY_S
    self.refused = 0  # connections closed at once, or given way: for tests and logs
    self._thread = threading.Thread(target=self._loop, name="sidecar-health-port", daemon=True)

  def start(self) -> HealthPort:
    for s in self._listeners:
      s.setblocking(False)
      self._selector.register(s, _R, None)
    self._selector.register(self._wake_r, _R, None)
    self._thread.start()
    return self

  def close(self) -> None:
    """Stops accepting, closes every connection and joins the thread; idempotent."""
    if self._stop.is_set():
      return
    self._stop.set()
    with contextlib.suppress(OSError):
      self._wake_w.send(b"x")
    if self._thread.is_alive():
      self._thread.join(5.0)
    for link in list(self._links.values()):
      self._end(link)
    for s in (*self._listeners, self._wake_r, self._wake_w):
      s.close()
    self._selector.close()

  @property
  def open_connections(self) -> int:
    return len(self.remotes)

  # ---- the loop ----------------------------------------------------------------------------

  def _loop(self) -> None:
    while not self._stop.is_set():
      now = time.monotonic()
      for key, mask in self._selector.select(self._timeout(now)):
        if self._stop.is_set():
          return
        if key.fileobj is self._wake_r:
          continue
        if key.data is None:
          self._accept(key.fileobj)  # type: ignore[arg-type]
        else:
          self._move(key.data, key.fileobj, mask)  # type: ignore[arg-type]
      self._expire(time.monotonic())

  def _timeout(self, now: float) -> float:
    if self._paused_until and now >= self._paused_until:
      self._paused_until = 0.0
      for s in self._listeners:
        self._selector.register(s, _R, None)
    due = [min(link.heard + self.idle_s, link.opened + self.life_s)
           for link in self._links.values()]
    if self._paused_until:
      due.append(self._paused_until)
    return max(0.0, min([now + 1.0, *due]) - now)

  def _expire(self, now: float) -> None:
    for link in [x for x in self._links.values()
                 if now - x.heard >= self.idle_s or now - x.opened >= self.life_s]:
      self._end(link)

  def _accept(self, listener: socket.socket) -> None:
    while True:
      try:
        client, address = listener.accept()
      except BlockingIOError:
        return
      except OSError as e:
        if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
          continue
        self._pause(e)
        return
      self._keep(client, remote_of(address))
      if self._paused_until:  # its relay found no descriptor
        return

  def _pause(self, error: OSError) -> None:
    """Out of descriptors (a flood on another port), buffers or memory: accepting rests
    for ``_ACCEPT_RETRY_S`` instead of spinning on the readable listener."""
    now = time.monotonic()
    if now - self._logged >= _LOG_EVERY_S:
      self._logged = now
      log.warning("health port %d: accept failed (%s); retrying every %.1f s", self.port,
                  error, _ACCEPT_RETRY_S)
    for s in self._listeners:
      with contextlib.suppress(KeyError, ValueError):
        self._selector.unregister(s)
    self._paused_until = now + _ACCEPT_RETRY_S

  def _keep(self, client: socket.socket, remote: str) -> None:
    try:
      gone = self.remotes.add(remote, client.fileno())
    except remotes.Full:
      self.refused += 1
      client.close()
      return
    for fd in gone:
      self.refused += 1
      self._end(self._links[fd], counted=False)  # type: ignore[index]  # our keys: fds
    try:
      inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as e:  # no descriptor left for its relay (EMFILE): it goes, accepting rests
      self.remotes.remove(remote, client.fileno())
      client.close()
      self._pause(e)
      return
    inner.setblocking(False)
    client.setblocking(False)
    if inner.connect_ex(self.inner) != 0:  # a Unix socket connects at once, or not at all
      self.remotes.remove(remote, client.fileno())
      client.close()
      inner.close()
      return
    link = _Link(remote, client, inner, time.monotonic())
    self._links[client.fileno()] = link
    self._selector.register(client, _R, link)
    self._selector.register(inner, _R, link)

  def _move(self, link: _Link, sock: socket.socket, mask: int) -> None:
    """Moves what ``sock`` has to read, and what waits to be written to it."""
    from_client = sock is link.client
    try:
      if mask & _W:
        out = link.down if from_client else link.up
        del out[:sock.send(out)]
      if mask & _R:
        into = link.up if from_client else link.down
        data = sock.recv(_BUFFER - len(into))
        if not data:
          if from_client:  # the probe is done
            return self._end(link)
          link.inner_done = True
        into += data
        if from_client:
          link.heard = time.monotonic()
    except (BlockingIOError, InterruptedError):
      pass
    except OSError:
      return self._end(link)
    if link.inner_done and not link.down:
      return self._end(link)
    self._interest(link)

  def _interest(self, link: _Link) -> None:
    """Each side read while the other's buffer has room, written while its own has bytes."""
    wants = ((link.client, (_R if len(link.up) < _BUFFER else 0) | (_W if link.down else 0)),
             (link.inner, (_R if len(link.down) < _BUFFER and not link.inner_done else 0)
              | (_W if link.up else 0)))
    for sock, events in wants:
      try:
        registered = self._selector.get_key(sock).events
      except KeyError:
        registered = 0
      if events == registered:
        continue
      if not events:
        self._selector.unregister(sock)
      elif registered:
        self._selector.modify(sock, events, link)
      else:
        self._selector.register(sock, events, link)

  def _end(self, link: _Link, *, counted: bool = True) -> None:
    fd = link.client.fileno()
    if self._links.pop(fd, None) is None:
      return
    if counted:
      self.remotes.remove(link.remote, fd)
    for sock in (link.client, link.inner):
      with contextlib.suppress(KeyError, ValueError):
        self._selector.unregister(sock)
      sock.close()
