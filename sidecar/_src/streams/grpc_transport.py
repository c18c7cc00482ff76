"""A stream over gRPC: the transport of a controller that does not map the host's arena."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import grpc

from sidecar._src.core import errors
from sidecar._src.streams import consumer
from sidecar._src.streams.consumer import Stream
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb

_END = object()
# How often a wait for an item looks whether its stream was closed meanwhile.
POLL_S = 0.1


class GrpcTransport(consumer.Transport):
  """Items of one ``Stream`` RPC, with values inline; a credit is one request message.

  A thread of the transport's own takes the items from gRPC and ``receive`` takes
  them from a queue: a Ctrl-C (KeyboardInterrupt) in ``next()`` then never lands
  inside gRPC's locks, which would hang the channel (see ``interrupts``).
  """

  def __init__(self, rpc: Callable[..., Any], start: pb.CallRequest, *, prefetch: int,
               metadata: Any, host: str, host_id: int,
               renew: Callable[[], Any] | None = None):
    self.host, self.host_id, self.poll_s = host, host_id, POLL_S
    self._rpc, self._start, self._prefetch = rpc, start, prefetch
    self._renew = renew  # a new session's metadata, where the sidecar lost ours
    self._taken = False  # an item came: the stream cannot start over unseen
    self._begin(metadata)

  def _begin(self, metadata: Any) -> None:
    self._requests: queue.SimpleQueue = queue.SimpleQueue()
    self._requests.put(pb.StreamRequest(start=self._start, prefetch=self._prefetch))
    self._responses = self._rpc(iter(self._requests.get, _END), metadata=metadata)
    self._items: queue.SimpleQueue = queue.SimpleQueue()  # items, then _END or an error
    self._reader = threading.Thread(target=self._read, daemon=True,
                                    name=f"sidecar-stream-{self.host_id}")
    self._reader.start()

  def _read(self) -> None:
    items = self._items
    try:
      for item in self._responses:
        items.put(item)
      items.put(_END)
    except Exception as e:  # grpc.RpcError, or anything: receive must not wait for nothing
      items.put(e)

  def receive(self, wait: float) -> pb.StreamItem | None:
    try:  # SimpleQueue.get is C: an interrupt leaves the queue as it was
      item = self._items.get(timeout=wait)
    except queue.Empty:
      return None
    if item is _END:
      return pb.StreamItem(end=True)
    if isinstance(item, grpc.RpcError):
      error = protocol.error_from_rpc(item, host=self.host, host_id=self.host_id)
      if (isinstance(error, errors.SessionLostError) and self._renew is not None
          and not self._taken):
        # The sidecar lost our session (a flood evicted it) before it started the stream:
        # once more, on a new session, as a call does.
        renew, self._renew = self._renew, None
        self._begin(renew())
        return None
      raise error from None
    if isinstance(item, Exception):
      raise item
    self._taken = True
    return item

  def check_alive(self, waited: float) -> None:
    pass  # A lost sidecar fails the RPC itself (keepalive, the controller's health watch).

  def credit(self, n: int, *, wait_s: float, saved: str = "") -> None:
    self._requests.put(pb.StreamRequest(credit=n, wait_s=wait_s, saved_state_json=saved))

  def close(self, *, owed: int) -> None:
    self._requests.put(_END)  # half-closes the requests: the sidecar's reader ends
    self._responses.cancel()
    # At interpreter exit (a finalizer's close) the reader may never run again: no wait.
    if self._reader is not threading.current_thread() and not sys.is_finalizing():
      self._reader.join(5)


def open_stream(rpc: Callable[..., Any], start: pb.CallRequest, *, prefetch: int,
                metadata: Any, timeout: float | None, host: str, host_id: int,
                to_device: consumer.ToDevice | None = None,
                renew: Callable[[], Any] | None = None) -> Stream:
  """Starts registered iterable ``start.name`` on a sidecar over gRPC; a credit per item.

  ``timeout`` bounds the wait for each item, ``to_device`` moves each item's arrays
  (see ``consumer.Stream``). ``renew`` handshakes again and returns the new session's
  metadata: a stream refused for a lost session (SessionLostError) starts once more.
  """
  consumer.check_prefetch(prefetch)
  transport = GrpcTransport(rpc, start, prefetch=prefetch, metadata=metadata, host=host,
                            host_id=host_id, renew=renew)
  return Stream(transport, name=start.name, timeout=timeout, to_device=to_device,
                kind="pipeline" if start.HasField("feed") else "stream")
