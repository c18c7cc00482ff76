"""The consumer of a sidecar stream, over a transport that only moves items and credits.

One :class:`Stream` holds what a user sees of ``ctl.stream`` (and what a feed reads
from each host): iteration, the end, the sidecar's error, a timeout per item that
leaves the stream open, ``close()``. Under it a :class:`Transport` moves
``pb.StreamItem``s in and credits out: over gRPC (``grpc_transport.py``) or over
the worker's Unix socket (``socket_transport.py``), where credits also carry the blocks
let go of. What lands on a device is the framework adapter's (a ``ToDevice`` hook).
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from typing import Any

from sidecar._src.core import errors, interrupts
from sidecar._src.wire import codec, feed_batch, protocol
from sidecar._src.wire.protocol import pb

# Moves an item's arrays onto a device (a framework adapter's: ``jax/transfer.to_devices``):
# a pytree of numpy arrays (arena views, which must stay alive as long as what is made
# of them) in, the same tree with the framework's arrays out.
ToDevice = Callable[[Any], Any]
# What a transport's receive hands back after its consumer closed it from another thread.
_CLOSED_ITEM = pb.StreamItem(end=True)


def check_prefetch(prefetch: Any) -> int:
  """``prefetch`` if it is an int from 1 to MAX_PREFETCH (what a sidecar allows), else
  InvalidArgumentError."""
  if not isinstance(prefetch, int) or prefetch < 1:
    raise errors.InvalidArgumentError(f"prefetch must be a positive int, got {prefetch!r}")
  if prefetch > protocol.MAX_PREFETCH:
    raise errors.InvalidArgumentError(
        f"prefetch must be at most {protocol.MAX_PREFETCH}, got {prefetch}; lower prefetch=")
  return prefetch


class Transport(abc.ABC):
  """Moves one stream's items from a sidecar, and its consumer's credits back.

  It knows nothing of values, deadlines or the end: :class:`Stream` does. A failure
  is raised as a SidecarError (HostLostError when the sidecar is gone or silent).

  Attributes:
    host: the sidecar's address, for messages.
    host_id: the sidecar's host id.
    poll_s: the longest one ``receive`` waits; between waits the consumer looks at its
      deadline and whether it was closed, then calls ``check_alive``.
    from_arena: turns an arena descriptor into an array, where the consumer maps the
      sidecar's arena; None where values arrive inline.
  """

  host: str
  host_id: int
  poll_s: float
  from_arena: codec.FromArena | None = None

  @abc.abstractmethod
  def receive(self, wait: float) -> pb.StreamItem | None:
    """The next item (one with ``end`` set ends the stream), or None if none came
    within ``wait`` seconds."""

  @abc.abstractmethod
  def check_alive(self, waited: float) -> None:
    """Raises HostLostError if the sidecar shows no sign of life; ``waited``: the
    seconds the consumer has waited for this item so far."""

  @abc.abstractmethod
  def credit(self, n: int, *, wait_s: float, saved: str = "") -> None:
    """Grants the sidecar ``n`` more items; ``wait_s``: what the consumer waited for them;
    ``saved``: a feed's, the host state of its trainer's latest save (told once)."""

  @abc.abstractmethod
  def close(self, *, owed: int) -> None:
    """Ends the stream; ``owed``: items taken and not yet credited. Called once."""


# Our errors a stream's end frame may carry that take their message alone and are no
# refusal about the pipeline: those are named with the iterable and the host
# (``Stream._named``).
_PLAIN = (errors.ResourceExhaustedError, errors.AuthenticationError)


class Stream:
  """Iterates what a registered iterable yields in one sidecar. Made by ``ctl.stream``.

  The sidecar runs at most ``prefetch`` items ahead: every item taken earns it a
  credit, sent ``credit_every`` at a time. ``next()`` raises StopIteration at the end
  and the sidecar's error if the iterable raised, and both close the stream; so does
  any failure of the transport (HostLostError when the sidecar is gone). A ``timeout``
  bounds the wait for one item: past it ``next()`` raises DeadlineExceededError and
  the stream stays open, so the caller may wait again. What the iterable itself raised
  (while it was built, or at any item) is a PipelineError naming it and the host.

  Example::

    with ctl.stream("batches", kwargs={"split": "train"}, prefetch=4) as s:
      for batch in s:
        ...

  Args:
    transport: what moves the items and credits.
    name: the registered iterable's name, for messages.
    credit_every: credits are sent once this many items were taken (one message for
      several); at most the prefetch.
    timeout: seconds one ``next()`` may wait for an item; None: no limit.
    to_device: with one, each item goes through it (arrays onto a device).
    kind: what runs, for its errors: ``"pipeline"`` (a feed's) or ``"stream"`` (a function's).
  """

  def __init__(self, transport: Transport, *, name: str, credit_every: int = 1,
               timeout: float | None = None, to_device: ToDevice | None = None,
               kind: str = "stream"):
    self._transport = transport
    self._name = name
    self._kind = kind
    self._credit_every = max(1, credit_every)
    self._timeout = timeout
    self._to_device = to_device
    self._owed, self._waited = 0, 0.0  # taken and not yet credited, and the wait for them
    self._saved = ""  # a save's feed state to tell with the next credit
    self.closed = False
    self._kept = interrupts.Kept()  # an item Ctrl-C left behind, for the next next()
    self.args: list = []  # the argument blocks, held as long as the stream

  def __iter__(self) -> Stream:
    return self

  def __next__(self) -> Any:
    # Ctrl-C raises only while no item is half taken: during the wait, or after the
    # item was made, which the next call then returns (``interrupts.Kept``).
    return self._kept.take(self._next)

  def _next(self) -> Any:
    if self.closed:
      raise StopIteration
    t = self._transport
    t0 = time.perf_counter()
    try:
      item = self._wait(t0)
    except Exception as e:
      closed_meanwhile = self.closed
      self.close()
      if closed_meanwhile:  # close() from another thread woke this wait
        raise StopIteration from None
      if isinstance(e, errors.SidecarError):  # how a gRPC stream ends with an error
        raise self._named(e) from None
      raise
    if item is None:  # The stream stays open: the caller may wait again.
      raise errors.DeadlineExceededError(
          f"no item of {self._name!r} from host {t.host_id} within the timeout of "
          f"{self._timeout:.3g} s")
    if item.end:
      self.close()
      if item.HasField("error"):
        raise self._named(protocol.error_from_info(item.error, host=t.host, host_id=t.host_id))
      raise StopIteration
    self._owed += 1
    self._waited += time.perf_counter() - t0
    if self._owed >= self._credit_every:
      owed, waited = self._owed, self._waited
      saved, self._saved = self._saved, ""
      self._owed, self._waited = 0, 0.0
      t.credit(owed, wait_s=waited, saved=saved)
    where = f"item {item.index} of {self._name!r} from host {t.host_id}"
    if item.HasField("batch"):  # a feed's: our own record, never a user's value
      return feed_batch.decode(item.batch, from_arena=t.from_arena, where=where)
    value = codec.decode(item.value, from_arena=t.from_arena, where=where)
    return value if self._to_device is None else self._to_device(value)

  def tell_saved(self, state_json: str) -> None:
    """A feed's: its trainer saved at host state ``state_json``; the sidecar is told with
    the next credit (sent by the thread that takes items: one writer on the stream)."""
    self._saved = state_json

  def _named(self, e: errors.SidecarError) -> errors.SidecarError:
    """The error that ended the stream, naming the iterable and the host: user code's
    (a RemoteError) as the PipelineError that names them; the sidecar's refusal about it
    (a path not found beneath its data roots, say) as the PipelineError of its kind
    (``PipelineError.of``); another of ours as the same class, its message prefixed with
    them."""
    host_id = self._transport.host_id
    if type(e) is errors.RemoteError:
      return errors.PipelineError(self._name, e.remote_type, e.remote_message,
                                  e.remote_traceback, host_id=e.host_id, kind=self._kind)
    if isinstance(e, errors.PipelineError):
      return e
    if (named := errors.PipelineError.of(e, self._name, host_id=host_id, kind=self._kind)):
      return named
    where = f"{self._kind} {self._name!r} on host {host_id}: "
    if type(e) not in _PLAIN or str(e).startswith(where):
      return e
    return type(e)(where + str(e))

  def _wait(self, t0: float) -> pb.StreamItem | None:
    """The next item; None once the timeout passed. A deferred Ctrl-C raises here, before
    an item is read: the main thread waits in steps of ``interrupts.POLL_S`` to see it."""
    t = self._transport
    step = (min(interrupts.POLL_S, t.poll_s)
            if threading.current_thread() is threading.main_thread() else t.poll_s)
    heard = t0
    while True:
      interrupts.check()
      wait = step
      if self._timeout is not None:
        wait = min(wait, t0 + self._timeout - time.perf_counter())
      item = t.receive(max(wait, 1e-3))
      if item is not None:
        return item
      if self.closed:
        return _CLOSED_ITEM
      now = time.perf_counter()
      if self._timeout is not None and now - t0 >= self._timeout:
        return None
      if now - heard >= t.poll_s - 1e-3:  # a sign of life after each poll_s of silence
        t.check_alive(now - t0)
        heard = time.perf_counter()

  def close(self) -> None:
    """Ends the stream; the sidecar stops producing. Idempotent.

    The sidecar learns how many items were taken, and takes back the blocks of
    those it sent ahead that were never read.
    """
    if self.closed:
      return
    self.closed = True
    self._kept.clear()
    owed, self._owed = self._owed, 0
    self._transport.close(owed=owed)

  def __del__(self) -> None:
    # No module globals here (contextlib...): at interpreter exit they may be None already.
    try:
      self.close()
    except Exception:  # A safety net: close() is the main path.
      pass

  def __enter__(self) -> Stream:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()
