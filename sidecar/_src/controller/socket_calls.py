"""Calls over a Worker's Unix socket: the fast path of ``ctl.call`` to a host whose arena
this process maps.

A ``calls`` connection (a :class:`Lane`) carries one call at a time: a CallRequest frame
out, a CallResponse frame back, with no TCP, HTTP/2 or gRPC thread in the way (a no-op
round trip is about a third of a gRPC unary's here). A host's idle lanes wait in its
:class:`Lanes` for the next call. The wait for a response polls, so Ctrl-C ends it at once
and never inside a lock; the call goes on in the sidecar, and whoever takes the lane
over (``calls.Calls``) reads its response and drops it.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from sidecar._src.arena.worker import Worker
from sidecar._src.core import errors
from sidecar._src.wire import ipc
from sidecar._src.wire.protocol import pb

IDLE_LANES = 4  # a host's idle connections kept for later calls; more are closed


class Lane:
  """One ``calls`` connection of ``worker``'s session.

  Raises:
    HostLostError: the sidecar cannot be reached.
  """

  def __init__(self, worker: Worker):
    self.worker = worker
    try:  # its server's user checked before the session goes
      self._sock = ipc.connect(worker.path, timeout=worker.timeout)
    except errors.PermissionDeniedError:
      raise
    except OSError as e:
      raise self._lost(e) from None
    try:
      ipc.send(self._sock, {"op": "calls", "session": worker.session})
    except OSError as e:
      self._sock.close()
      raise self._lost(e) from None
    self._frames = ipc.FrameReader(self._sock, limit=1 << 30)  # its own sidecar's answers

  def _lost(self, e: BaseException) -> errors.HostLostError:
    return errors.HostLostError(f"the sidecar of host {self.worker.host_id} at "
                                f"{self.worker.path} is gone during a call: {e}",
                                host_id=self.worker.host_id)

  def send(self, request: pb.CallRequest) -> None:
    try:
      self._sock.settimeout(self.worker.timeout)
      ipc.send_bytes(self._sock, request.SerializeToString())
    except OSError as e:
      raise self._lost(e) from None

  def receive(self, wait: float | None) -> pb.CallResponse | None:
    """The response, or None if none came within ``wait`` seconds (None: until it comes);
    a response cut short by the timeout is read on at the next call."""
    self._sock.settimeout(wait)
    try:
      return pb.CallResponse.FromString(self._frames.read())
    except TimeoutError:
      return None
    except (OSError, ConnectionError) as e:
      raise self._lost(e) from None

  def close(self) -> None:
    """Closes the connection; a thread blocked in :meth:`receive` raises HostLostError."""
    with contextlib.suppress(OSError):
      self._sock.shutdown(socket.SHUT_RDWR)
    self._sock.close()


class Lanes:
  """One host's lanes: those idle, and those a call has (``close()`` closes both)."""

  def __init__(self, worker: Worker):
    self.worker = worker
    self._lock = threading.Lock()
    self._idle: list[Lane] = []
    self._busy: set[Lane] = set()
    self._closed = False

  def take(self) -> Lane:
    """An idle lane, or a new one.

    Raises:
      ClosedError: after close(). HostLostError: the sidecar cannot be reached.
    """
    with self._lock:
      if self._closed:
        raise errors.ClosedError("the controller's calls are closed")
      lane = self._idle.pop() if self._idle else None
      if lane is not None:
        self._busy.add(lane)
        return lane
    lane = Lane(self.worker)
    with self._lock:
      if not self._closed:
        self._busy.add(lane)
        return lane
    lane.close()
    raise errors.ClosedError("the controller's calls are closed")

  def give_back(self, lane: Lane, *, usable: bool = True) -> None:
    """Returns ``lane`` after its call's response was read (``usable``), else closes it."""
    with self._lock:
      self._busy.discard(lane)
      keep = usable and not self._closed and len(self._idle) < IDLE_LANES
      if keep:
        self._idle.append(lane)
    if not keep:
      lane.close()

  def close(self) -> None:
    """Closes every lane, idle or busy (a busy one's reader gets HostLostError); idempotent."""
    with self._lock:
      self._closed = True
      lanes = [*self._idle, *self._busy]
      self._idle, self._busy = [], set()
    for lane in lanes:
      lane.close()
