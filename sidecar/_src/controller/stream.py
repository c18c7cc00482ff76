"""A controller-side stream: items of a sidecar iterable, with credit-based backpressure."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from sidecar._src import codec, errors, protocol, transfer
from sidecar._src.protocol import pb

_END = object()


class Stream:
  """Iterates what a registered iterable yields in one sidecar.

  The sidecar runs at most ``prefetch`` items ahead; each ``next()`` grants one
  more. Values arrive inline: a controller that maps the sidecar's arena uses
  the worker's Unix socket instead (``worker.LocalStream``).

  A thread of the stream's own takes the items from gRPC and ``next()`` takes them
  from a queue: a Ctrl-C (KeyboardInterrupt) in ``next()`` then never lands inside
  gRPC's locks, which would hang the channel (see ``interrupts``).
  """

  def __init__(self, rpc: Callable[..., Any], start: pb.CallRequest, *, prefetch: int,
               metadata, timeout: float | None, host: str, host_id: int,
               device: Any = None):
    if not isinstance(prefetch, int) or prefetch < 1:
      raise errors.InvalidArgumentError(f"prefetch must be a positive int, got {prefetch!r}")
    self._requests: queue.SimpleQueue = queue.SimpleQueue()
    self._requests.put(pb.StreamRequest(start=start, prefetch=prefetch))
    self._responses = rpc(iter(self._requests.get, _END), metadata=metadata, timeout=timeout)
    self._host, self._host_id = host, host_id
    self._name = start.name
    self._device = device
    self.closed = False
    self.args: list = []
    self._items: queue.SimpleQueue = queue.SimpleQueue()  # items, then _END or an error
    self._reader = threading.Thread(target=self._read, daemon=True,
                                    name=f"sidecar-stream-{host_id}")
    self._reader.start()

  def _read(self) -> None:
    try:
      for item in self._responses:
        self._items.put(item)
      self._items.put(_END)
    except grpc.RpcError as e:
      self._items.put(e)
    except Exception as e:  # a safety net: next() must not wait for nothing
      self._items.put(e)

  def _take(self) -> Any:
    while True:  # SimpleQueue.get is C: an interrupt leaves the queue as it was
      try:
        return self._items.get(timeout=0.1)
      except queue.Empty:
        if self.closed:
          return _END

  def __iter__(self) -> Iterator[Any]:
    return self

  def __next__(self) -> Any:
    if self.closed:
      raise StopIteration
    t0 = time.perf_counter()
    item = self._take()
    if item is _END:
      self.close()
      raise StopIteration
    if isinstance(item, grpc.RpcError):
      self.close()
      raise protocol.error_from_rpc(item, host=self._host, host_id=self._host_id) from None
    if isinstance(item, Exception):
      self.close()
      raise item
    self._requests.put(pb.StreamRequest(credit=1, wait_s=time.perf_counter() - t0))
    value = codec.decode(item.value,
                         where=f"item {item.index} of {self._name!r} from host {self._host_id}")
    return value if self._device is None else transfer.to_devices(value, self._device)

  def close(self) -> None:
    """Ends the stream; the sidecar stops producing. Idempotent."""
    if self.closed:
      return
    self.closed = True
    self._requests.put(_END)
    self._responses.cancel()
    if self._reader is not threading.current_thread():
      self._reader.join(5)

  def __enter__(self) -> Stream:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
