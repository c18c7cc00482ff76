"""A stream over the worker's Unix socket: the transport of a process that maps the arena.

Opened by whoever opens the stream (the controller), on a :class:`~sidecar._src.arena.worker.Worker`
of the stream's host: arrays arrive as views of that arena with no copy, and credits carry
the blocks let go of meanwhile.
"""

from __future__ import annotations

import contextlib
import socket

from sidecar._src.arena.worker import Worker
from sidecar._src.core import errors
from sidecar._src.streams import consumer
from sidecar._src.streams.consumer import Stream
from sidecar._src.wire import ipc
from sidecar._src.wire.protocol import pb


class SocketTransport(consumer.Transport):
  """A stream's own connection to the worker's sidecar: item frames in, credit frames out.

  Credits carry the blocks let go of meanwhile. While the consumer waits, the worker
  asks the sidecar for a sign of life after every half peer timeout of silence, so a
  slow pipeline is waited on but a hung or stopped sidecar ends the stream with
  HostLostError within about the peer timeout.
  """

  def __init__(self, worker: Worker, sock: socket.socket, name: str):
    self._worker = worker
    self._sock = sock
    self._frames = ipc.FrameReader(sock, limit=1 << 30)
    self._name = name
    self.host, self.host_id = worker.path, worker.host_id
    self.poll_s = worker.quiet_s
    self.from_arena = worker.view

  def receive(self, wait: float) -> pb.StreamItem | None:
    self._sock.settimeout(wait)
    try:
      return pb.StreamItem.FromString(self._frames.read())
    except TimeoutError:
      return None  # The reader stays where it was.
    except (OSError, ConnectionError) as e:
      raise errors.HostLostError(
          f"the sidecar of host {self.host_id} at {self.host} is gone during stream "
          f"{self._name!r}: {e}", host_id=self.host_id) from None

  def check_alive(self, waited: float) -> None:
    try:
      self._worker.check_alive(self.poll_s)
    except errors.HostLostError as e:
      raise errors.HostLostError(f"no item of stream {self._name!r} for {waited:.3g} s, and {e}",
                                 host_id=self.host_id) from None

  def credit(self, n: int, *, wait_s: float, saved: str = "") -> None:
    message = pb.StreamRequest(credit=n, freed=self._worker.take_freed(), wait_s=wait_s,
                               saved_state_json=saved)
    try:
      self._sock.settimeout(self._worker.timeout)  # receive may have left a short one
      ipc.send_bytes(self._sock, message.SerializeToString())
    except OSError:
      pass  # The sidecar already finished; the end frame waits in the socket.

  def close(self, *, owed: int) -> None:
    # The sidecar learns how many items were taken: it takes back the blocks of those
    # it sent ahead that were never read.
    done = pb.StreamRequest(credit=owed, freed=self._worker.take_freed(), close=True)
    with contextlib.suppress(OSError):
      self._sock.settimeout(self._worker.timeout)
      ipc.send_bytes(self._sock, done.SerializeToString())
    with contextlib.suppress(OSError):  # wakes a reader blocked on another thread
      self._sock.shutdown(socket.SHUT_RDWR)
    self._sock.close()


def open_stream(worker: Worker, request: pb.CallRequest, *, prefetch: int,
                timeout: float | None = None, to_device: consumer.ToDevice | None = None
                ) -> Stream:
  """Runs a registered iterable in ``worker``'s sidecar; its items arrive over the socket.

  Credits go back in batches of half the prefetch (one message for several items),
  with the blocks freed meanwhile. ``timeout`` bounds the wait for each item (see
  ``consumer.Stream``); ``to_device`` moves each item's arrays where the trainer wants
  them (a framework adapter's; on JAX's CPU backend, views of the arena: no copy).
  """
  worker.check_usable()
  consumer.check_prefetch(prefetch)
  request.worker_session = worker.session
  try:  # its server's user checked before the session goes
    sock = ipc.connect(worker.path, timeout=worker.timeout)
  except errors.PermissionDeniedError:
    raise
  except OSError as e:
    raise errors.HostLostError(f"the sidecar of host {worker.host_id} is gone: {e}",
                               host_id=worker.host_id) from None
  try:
    ipc.send(sock, {"op": "stream", "session": worker.session})
    ipc.send_bytes(sock, pb.StreamRequest(start=request, prefetch=prefetch).SerializeToString())
  except OSError as e:
    sock.close()
    raise errors.HostLostError(f"the sidecar of host {worker.host_id} is gone: {e}",
                               host_id=worker.host_id) from None
  return Stream(SocketTransport(worker, sock, request.name), name=request.name,
                credit_every=prefetch // 2, timeout=timeout, to_device=to_device,
                kind="pipeline" if request.HasField("feed") else "stream")

