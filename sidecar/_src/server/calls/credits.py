"""Credits: how far a stream's producer may run ahead of its consumer.

A consumer opens a stream with its ``prefetch`` (the items it will buffer) and
grants one credit per item it takes; the producer takes a credit before it makes
each item. Both ways in keep the same count (:class:`Bank`) and differ only in who
reads the consumer's grants:

- :class:`Credits` (gRPC): a reader thread grants, the producer waits on a condition;
- :class:`SocketCredits` (the worker socket): the producer reads the grants itself,
  with no thread hop per item.

A feed's consumer also says, with a credit, where its trainer saved (``saved``): the
feed's kept batches before that position will not be re-done (``feeds/kept.py``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Protocol

from sidecar._src.wire import codec, ipc
from sidecar._src.wire.protocol import pb


class CreditSource(Protocol):
  """What a stream's producer takes credits from: :class:`Credits` or :class:`SocketCredits`."""

  @property
  def consumer_wait_s(self) -> float:
    """What the consumer reported waiting for items, in all."""
    ...

  @property
  def prefetch(self) -> int:
    """The most items the consumer buffers (its credits at the start)."""
    ...

  def take(self) -> bool:
    """Uses a credit, waiting for one; False once the consumer will take no more."""
    ...

  def take_saved(self) -> str:
    """The host feed state of the trainer's latest save the consumer told since the last
    call (JSON), or "" where it told none."""
    ...


class Bank:
  """The count itself: credits granted and not yet used, never above the prefetch."""

  __slots__ = ("available", "most", "consumer_wait_s", "saved")

  def __init__(self, prefetch: int):
    self.available = self.most = prefetch
    self.consumer_wait_s = 0.0  # what the consumer reported waiting, in all
    self.saved = ""  # the latest save's feed state the consumer told, not yet taken

  def grant(self, n: int, wait_s: float = 0.0, saved: str = "") -> None:
    # A consumer never has more than its prefetch outstanding: more is ignored, so a
    # client cannot make the sidecar run ahead without bound.
    self.available = min(self.available + n, self.most)
    self.consumer_wait_s += wait_s
    if saved:
      self.saved = saved

  def take_saved(self) -> str:
    saved, self.saved = self.saved, ""
    return saved

  def spend(self) -> bool:
    """Uses a credit if one is there."""
    if self.available <= 0:
      return False
    self.available -= 1
    return True


class Credits:
  """Credits granted from another thread; ``take`` blocks until one is granted."""

  def __init__(self, initial: int):
    self._cond = threading.Condition()
    self._bank = Bank(initial)
    self._open = True
    self._granting = True  # more grants may come

  @property
  def consumer_wait_s(self) -> float:
    return self._bank.consumer_wait_s

  @property
  def prefetch(self) -> int:
    return self._bank.most

  def grant(self, n: int, wait_s: float = 0.0, saved: str = "") -> None:
    with self._cond:
      self._bank.grant(n, wait_s, saved)
      self._cond.notify()

  def take_saved(self) -> str:
    with self._cond:
      return self._bank.take_saved()

  def close(self) -> None:
    """The consumer is gone: ``take`` returns False from now on."""
    with self._cond:
      self._open = False
      self._cond.notify()

  def finish(self) -> None:
    """No more grants will come (the consumer half-closed its requests): ``take`` still
    gives the credits granted so far, then returns False."""
    with self._cond:
      self._granting = False
      self._cond.notify()

  def take(self) -> bool:
    with self._cond:
      while self._bank.available <= 0 and self._open and self._granting:
        self._cond.wait()
      return self._open and self._bank.spend()


class SocketCredits:
  """Credits read by the producing thread itself from a worker's stream connection.

  ``take`` uses a credit if one is banked, reading whatever credit frames are
  already waiting without blocking; with none banked it blocks for the next
  frame. A closed socket means the consumer is gone: ``take`` returns False.
  The frames also carry the blocks the worker let go of (``on_freed``) and, at
  the end, how many items it took in all (``taken``, once ``closed``).
  """

  def __init__(self, conn: socket.socket, initial: int, on_freed: Callable[[list[int]], None],
               *, on_taken: Callable[[int], None] = lambda n: None):
    self._conn = conn
    self._reader = ipc.FrameReader(conn)
    self._bank = Bank(initial)
    self._on_freed = on_freed
    self._on_taken = on_taken  # the consumer took items: its trainer's step progress
    self.taken = 0  # items the consumer reported taken
    self.closed = False  # the consumer said it is done
    self.gone = False  # its socket failed: the consumer closed it unsaid, or died

  @property
  def consumer_wait_s(self) -> float:
    return self._bank.consumer_wait_s

  @property
  def prefetch(self) -> int:
    return self._bank.most

  def _read(self, block: bool) -> None:
    """Takes the credit frames waiting (with ``block``, waits for one). The socket
    failing (OSError, only around its own I/O) means the consumer is gone (``gone``)."""
    while not self.closed and not self.gone:
      try:
        # The connection has no timeout (workers.py): a frame not there is BlockingIOError.
        raw = self._reader.read(wait=block)
      except BlockingIOError:
        return  # nothing more waiting
      except OSError:  # ConnectionError included: the consumer closed it, or died
        self.gone = True
        return
      message = codec.parse(pb.StreamRequest, raw)  # InvalidArgumentError if garbage
      self._bank.grant(message.credit, message.wait_s, message.saved_state_json)
      self.taken += message.credit
      self.closed = message.close
      if message.credit and not message.close:
        self._on_taken(message.credit)
      if message.freed:
        self._on_freed(list(message.freed))
      if block:
        return

  def take(self) -> bool:
    while True:
      self._read(block=self._bank.available <= 0)
      if self.closed or self.gone:
        return False
      if self._bank.spend():
        return True
      # A frame with no credit (only frees): wait for the next.

  def drain(self) -> None:
    """Reads what the consumer sent and nobody read yet (its close, say)."""
    self._read(block=False)

  def take_saved(self) -> str:
    return self._bank.take_saved()
