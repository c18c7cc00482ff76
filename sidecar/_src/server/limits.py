"""Bounds on what clients of the control port can hold: RPC slots and handshake sessions.

A gRPC stream holds a server thread for as long as it lives (it waits for credits in
it), so streams get a budget of their own, ``max_streams`` threads beside the
``threads`` that serve handshakes, calls and status: streams that never send a credit
can fill their budget, never the rest. Unary calls hold a thread while they run: they
may take most of ``threads`` but never all, and one session at most half, so slow calls
of one client leave threads for handshakes, status and other sessions' calls.
Handshake sessions are tokens in a bounded, expiring table: a flood of handshakes costs
a bounded amount of memory.
"""

from __future__ import annotations

import collections
import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator

from sidecar._src.core import errors
from sidecar._src.wire.protocol import MAX_PREFETCH


def check_prefetch(prefetch: int) -> int:
  """A stream's ``prefetch`` (0 counts as 1), checked.

  Raises:
    InvalidArgumentError: it exceeds MAX_PREFETCH.
  """
  if prefetch > MAX_PREFETCH:
    raise errors.InvalidArgumentError(
        f"prefetch must be at most {MAX_PREFETCH}, got {prefetch}; lower prefetch=")
  return max(prefetch, 1)


class Slots:
  """At most ``total`` RPCs of one kind at once, and at most ``per_session`` of one session."""

  def __init__(self, *, total: int, per_session: int):
    self.total, self.per_session = total, per_session
    self._lock = threading.Lock()
    self._open: collections.Counter[str] = collections.Counter()
    self._count = 0

  def _full(self) -> str:
    return (f"this sidecar already runs {self._count} streams, its limit (max_streams="
            f"{self.total}); close streams or feeds that are done, or raise max_streams")

  def _session_full(self, session: str) -> str:
    return (f"session {session} already runs {self._open[session]} streams, the limit of one "
            f"session (max_streams_per_session={self.per_session}); close streams or feeds "
            "that are done")

  @contextlib.contextmanager
  def hold(self, session: str) -> Iterator[None]:
    """A slot for one RPC of ``session`` while the block runs.

    Raises:
      BusyError: a limit is reached; the message names it and its option.
    """
    with self._lock:
      if self._count >= self.total:
        raise errors.BusyError(self._full())
      if self._open[session] >= self.per_session:
        raise errors.BusyError(self._session_full(session))
      self._open[session] += 1
      self._count += 1
    try:
      yield
    finally:
      with self._lock:
        self._count -= 1
        self._open[session] -= 1
        if not self._open[session]:
          del self._open[session]

  @property
  def running(self) -> int:
    with self._lock:
      return self._count


StreamSlots = Slots  # streams: max_streams, max_streams_per_session


class CallSlots(Slots):
  """Slots for unary calls, from the ``threads`` that serve handshakes, calls and status.

  Calls may hold all but an eighth of them (at least one stays free for handshakes,
  status and the refusals of calls past a limit), one session at most half: a client
  with slow calls takes neither another session's threads nor those of handshakes and
  status.
  """

  def __init__(self, threads: int):
    self.threads = threads
    super().__init__(total=max(1, threads - max(1, threads // 8)),
                     per_session=max(1, threads // 2))

  def _full(self) -> str:
    return (f"this sidecar already runs {self._count} calls, its limit (all but an eighth "
            f"of threads={self.threads}); wait for calls in flight, or raise threads")

  def _session_full(self, session: str) -> str:
    return (f"session {session} already runs {self._open[session]} calls, the limit of one "
            f"session (half of threads={self.threads}: {self.per_session}); wait for its "
            "calls in flight to return before starting more")


# The Checkpoint service's rpcs (a save's phases, restore reads, peers' replica
# streams) have threads of their own beside those of calls and streams: at most this many
# at once, half of them one session's (a controller's, or a peer sidecar's replicas).
CHECKPOINT_THREADS = 16


class CheckpointSlots(Slots):
  """Slots for the Checkpoint service: ``CHECKPOINT_THREADS`` threads, half per session."""

  def __init__(self, total: int = CHECKPOINT_THREADS):
    super().__init__(total=total, per_session=max(1, total // 2))

  def _full(self) -> str:
    return (f"this sidecar already runs {self._count} checkpoint rpcs, its limit "
            f"({self.total}); wait for saves and restores in flight")

  def _session_full(self, session: str) -> str:
    return (f"session {session} already runs {self._open[session]} checkpoint rpcs, the "
            f"limit of one session ({self.per_session}); wait for those in flight")


# A session used this recently is never evicted to make room for a new one.
EVICT_IDLE_S = 60.0


class Sessions:
  """Handshake sessions: random tokens, dropped after ``idle_s`` unused, at most ``limit``.

  Every use refreshes a session. Past ``limit`` the one unused the longest goes, if it
  was unused for ``evict_idle_s`` at least; else the new handshake is refused
  (RESOURCE_EXHAUSTED): a flood of handshakes never evicts a session in use.
  """

  def __init__(self, *, idle_s: float, limit: int, evict_idle_s: float = EVICT_IDLE_S,
               clock: Callable[[], float] = time.monotonic):
    self.idle_s, self.limit = idle_s, limit
    self.evict_idle_s = min(evict_idle_s, idle_s)
    self._clock = clock
    self._lock = threading.Lock()
    self._last: collections.OrderedDict[str, float] = collections.OrderedDict()  # oldest first
    self._peers: set[str] = set()  # sessions of peer sidecars (they presented the peer token)
    self._clients: dict[str, str] = {}  # session -> client name, with per-client tokens
    self.expired = 0  # sessions dropped, idle or evicted

  def new(self, *, peer: bool = False, client: str | None = None) -> str:
    """A new session; ``peer``: a peer sidecar's, which may send replicas; ``client``: the
    name of the client whose token made it (per-client tokens)."""
    session = ("p-" if peer else "c-") + secrets.token_hex(16)
    with self._lock:
      now = self._clock()
      self._sweep(now)
      if len(self._last) >= self.limit:
        oldest, last = next(iter(self._last.items()))
        if now - last < self.evict_idle_s:
          raise errors.BusyError(
              f"this sidecar keeps {self.limit} handshake sessions (max_sessions), every one "
              f"used in the last {self.evict_idle_s:g} s; handshake again later, or raise "
              "max_sessions")
        self._drop(oldest)
      self._last[session] = now
      if peer:
        self._peers.add(session)
      if client is not None:
        self._clients[session] = client
    return session

  def _drop(self, session: str) -> None:
    del self._last[session]
    self._peers.discard(session)
    self._clients.pop(session, None)
    self.expired += 1

  def _sweep(self, now: float) -> None:
    while self._last:
      oldest, last = next(iter(self._last.items()))
      if now - last < self.idle_s:
        return
      self._drop(oldest)

  def client(self, session: object) -> str | None:
    """The client name of ``session`` (per-client tokens), else None."""
    with self._lock:
      return self._clients.get(session) if isinstance(session, str) else None

  def is_peer(self, session: object) -> bool:
    """Whether ``session`` is a live peer sidecar's."""
    with self._lock:
      return isinstance(session, str) and session in self._peers

  def touch(self, session: object) -> bool:
    """Refreshes ``session`` if it is live; whether it was."""
    try:
      self.use(session)
    except errors.SessionLostError:
      return False
    return True

  def use(self, session: object) -> None:
    """Refreshes ``session``.

    Raises:
      SessionLostError: it is unknown, or expired (FAILED_PRECONDITION: handshake again).
    """
    with self._lock:
      now = self._clock()
      last = self._last.get(session) if isinstance(session, str) else None
      if isinstance(session, str) and last is not None and now - last < self.idle_s:
        self._last[session] = now
        self._last.move_to_end(session)
        return
      self._sweep(now)
    raise errors.SessionLostError(
        f"no live handshake session {session!r:.100} (none was made, or it was unused for "
        f"{self.idle_s:g} s, or for {self.evict_idle_s:g} s and evicted by a newer one); "
        "call Handshake first and send its session as metadata 'sidecar-session'")

  def __len__(self) -> int:
    with self._lock:
      return len(self._last)


# Bytes of large inline requests (those with arrays left in their wire bytes) being decoded
# at once: each costs about its size again while its arrays are copied out, so together
# they cost at most this (one larger request still runs, alone).
INLINE_BYTES_IN_FLIGHT = 256 << 20


class InlineBytes:
  """At most ``limit`` bytes of large inline requests decoded at once; the others wait,
  within their deadline."""

  def __init__(self, limit: int = INLINE_BYTES_IN_FLIGHT):
    self.limit = limit
    self._cv = threading.Condition()
    self._held = 0

  @contextlib.contextmanager
  def hold(self, nbytes: int, timeout: float | None) -> Iterator[None]:
    """Holds ``nbytes`` of the budget while the block runs.

    Raises:
      BusyError: no room within ``timeout`` seconds (None: wait as long as it takes).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cv:
      while self._held and self._held + nbytes > self.limit:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise errors.BusyError(
              f"this sidecar is decoding {self._held} bytes of inline requests, its limit "
              f"({self.limit}, limits.INLINE_BYTES_IN_FLIGHT); pass large arrays through a "
              "Worker's arena, or retry")
        self._cv.wait(left)
      self._held += nbytes
    try:
      yield
    finally:
      with self._cv:
        self._held -= nbytes
        self._cv.notify_all()
