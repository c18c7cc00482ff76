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
import ctypes
import ctypes.util
import functools
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sidecar._src.core import errors
from sidecar._src.server.tenancy import quotas as quotas_lib, tenants as tenants_lib
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
  """At most ``total`` RPCs of one kind at once, and at most ``per_session`` of one session.

  With tenants (``tenancy``, ``tenant_of``: a session's tenant), at most a tenant's
  ``quota`` (``quotas.STREAMS``, ``CALLS``) of its sessions together; a pool file's tenant
  without one gets its share of ``total`` by weight, so no tenant takes them all.
  """

  def __init__(self, *, total: int, per_session: int,
               tenancy: tenants_lib.Tenancy | None = None,
               tenant_of: Callable[[str], str | None] = lambda session: None,
               quota: quotas_lib.Count = quotas_lib.STREAMS):
    self.total, self.per_session = total, per_session
    self.quota = quota
    self.kind = quota.key  # what the rpcs are called in messages
    self._tenancy, self._tenant_of = tenancy, tenant_of
    self._lock = threading.Lock()
    self._open: collections.Counter[str] = collections.Counter()
    self._by_tenant: collections.Counter[str] = collections.Counter()
    self._count = 0

  def tenant_limit(self, name: str | None) -> tuple[int, str] | None:
    """The most RPCs of this kind tenant ``name`` may run at once, and what sets it."""
    t = None if self._tenancy is None else self._tenancy.tenant(name)
    if t is None or self._tenancy is None:
      return None
    limit = self.quota.limit(t, self._tenancy.pool, total=self.total)
    return None if limit is None else (limit.most, limit.why)

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
    tenant = self._tenant_of(session)
    limit = self.tenant_limit(tenant)
    with self._lock:
      if limit is not None and tenant is not None and self._by_tenant[tenant] >= limit[0]:
        # Busy: the same request succeeds once its tenant's own rpcs in flight end (a
        # controller asks a checkpoint rpc again, within its deadline).
        raise errors.BusyError(
            f"tenant {tenant!r} already runs {self._by_tenant[tenant]} {self.kind}, its quota "
            f"({limit[1]}); wait for those in flight, or raise its quota in the pool file")
      if self._count >= self.total:
        raise errors.BusyError(self._full())
      if self._open[session] >= self.per_session:
        raise errors.BusyError(self._session_full(session))
      self._open[session] += 1
      self._count += 1
      if tenant is not None:
        self._by_tenant[tenant] += 1
    try:
      yield
    finally:
      with self._lock:
        self._count -= 1
        self._open[session] -= 1
        if not self._open[session]:
          del self._open[session]
        if tenant is not None:
          self._by_tenant[tenant] -= 1
          if not self._by_tenant[tenant]:
            del self._by_tenant[tenant]

  @property
  def running(self) -> int:
    with self._lock:
      return self._count

  def by_tenant(self) -> dict[str, int]:
    """The RPCs of this kind each tenant runs now."""
    with self._lock:
      return dict(self._by_tenant)


StreamSlots = Slots  # streams: max_streams, max_streams_per_session


class CallSlots(Slots):
  """Slots for unary calls, from the ``threads`` that serve handshakes, calls and status.

  Calls may hold all but an eighth of them (at least one stays free for handshakes,
  status and the refusals of calls past a limit), one session at most half: a client
  with slow calls takes neither another session's threads nor those of handshakes and
  status.
  """

  def __init__(self, threads: int, *, tenancy: tenants_lib.Tenancy | None = None,
               tenant_of: Callable[[str], str | None] = lambda session: None):
    self.threads = threads
    super().__init__(total=max(1, threads - max(1, threads // 8)),
                     per_session=max(1, threads // 2), tenancy=tenancy, tenant_of=tenant_of,
                     quota=quotas_lib.CALLS)

  def _full(self) -> str:
    return (f"this sidecar already runs {self._count} calls, its limit (all but an eighth "
            f"of threads={self.threads}); wait for calls in flight, or raise threads")

  def _session_full(self, session: str) -> str:
    return (f"session {session} already runs {self._open[session]} calls, the limit of one "
            f"session (half of threads={self.threads}: {self.per_session}); wait for its "
            "calls in flight to return before starting more")


# The Checkpoint service's rpcs (a save's sequence, restore reads, peers' replica
# streams) have threads of their own beside those of calls and streams: at most this many
# at once, half of them one session's (a controller's, or another sidecar's replicas).
CHECKPOINT_THREADS = 16


class CheckpointSlots(Slots):
  """Slots for the Checkpoint service: ``CHECKPOINT_THREADS`` threads, half per session."""

  def __init__(self, total: int = CHECKPOINT_THREADS, *,
               tenancy: tenants_lib.Tenancy | None = None,
               tenant_of: Callable[[str], str | None] = lambda session: None):
    super().__init__(total=total, per_session=max(1, total // 2), tenancy=tenancy,
                     tenant_of=tenant_of, quota=quotas_lib.CHECKPOINT_RPCS)

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

  Every use refreshes a session. Each is held by the client that made it (``holder``: its
  TCP connection, ``connection_of``; over a ``unix:`` socket its process, ``client_ids``), which
  keeps at most ``per_client``: past it, that
  client's own oldest goes. Past ``limit``, room is made by whoever holds the most,
  oldest first: a client holding more sessions than the new one's client would (a
  flood), else the new one's own client; else the one unused the longest goes, if it
  was unused for ``evict_idle_s`` at least; else the new handshake is refused
  (RESOURCE_EXHAUSTED). So one client's flood of handshakes evicts its own sessions, and
  never locks another client out, nor evicts a session of a client holding one.

  With tenants (``tenancy``), each tenant keeps at most its ``sessions`` quota (a pool
  file's tenant without one: its share of ``limit`` by weight), evicting only its own: one
  tenant's flood of handshakes is refused as its own, and never fills the table that the
  other tenants' handshakes need. Where the quotas add up to more than ``limit``, a full
  table makes room only from the new one's tenant or a tenant holding more than its share
  by weight (``_evictable``): never from a tenant within its share.
  """

  def __init__(self, *, idle_s: float, limit: int, evict_idle_s: float = EVICT_IDLE_S,
               clock: Callable[[], float] = time.monotonic,
               tenancy: tenants_lib.Tenancy | None = None, per_client: int | None = None):
    self.idle_s, self.limit = idle_s, limit
    self.per_client = limit if per_client is None else min(per_client, limit)
    self._tenancy = tenancy
    self.evict_idle_s = min(evict_idle_s, idle_s)
    self._clock = clock
    self._lock = threading.Lock()
    self._last: collections.OrderedDict[str, float] = collections.OrderedDict()  # oldest first
    # Sessions of replica links (other sidecars, that presented the peer token).
    self._replica_links: set[str] = set()
    self._clients: dict[str, str] = {}  # session -> client name, with per-client tokens
    self._holders: dict[str, str] = {}  # session -> the connection that made it
    self._held: collections.Counter[str] = collections.Counter()  # sessions per holder
    self.expired = 0  # sessions dropped, idle or evicted

  def new(self, *, replica_link: bool = False, client: str | None = None,
          holder: str | None = None) -> str:
    """A new session; ``replica_link``: another sidecar's replica link, which may send
    replicas; ``client``: the name of the client whose token made it (per-client tokens);
    ``holder``: the connection it came over (``connection_of``; None: not known, a Unix
    socket's)."""
    session = ("p-" if replica_link else "c-") + secrets.token_hex(16)
    quota = self._quota(client)
    with self._lock:
      now = self._clock()
      self._sweep(now)
      if quota is not None and client is not None:
        self._make_room(client, quota, now)
      if holder is not None and self._held[holder] >= self.per_client:
        self._drop(self._oldest_of(holder))  # a flood of one client: its own oldest
      if len(self._last) >= self.limit:
        self._make_any_room(holder, now, client)
      self._last[session] = now
      if replica_link:
        self._replica_links.add(session)
      if client is not None:
        self._clients[session] = client
      if holder is not None:
        self._holders[session] = holder
        self._held[holder] += 1
    return session

  def _oldest_of(self, holder: str) -> str:
    """The least recently used session of ``holder`` (which holds one at least)."""
    return next(s for s in self._last if self._holders.get(s) == holder)

  def _evictable(self, client: str | None) -> set[str | None] | None:
    """The tenants whose biggest holder a handshake of tenant ``client`` may make room
    from: its own, and those holding more than their share by weight of ``limit`` (a pool
    file's quotas may add up to more). None: any (no pool, or no tenant named)."""
    pool = None if self._tenancy is None else self._tenancy.pool
    if pool is None or client is None or not pool.tenants:
      return None
    weights = sum(t.weight for t in pool.tenants) or 1.0
    counts = collections.Counter(self._clients.get(s) for s in self._last)
    over = {t.name for t in pool.tenants if counts[t.name] > self.limit * t.weight / weights}
    return {client, *over}

  def _make_any_room(self, holder: str | None, now: float, client: str | None = None) -> None:
    """Room for one more session in the full table: see the class docstring.

    Raises:
      BusyError: every session is held by a client holding as few as the new one's, and
        was used in the last ``evict_idle_s``.
    """
    mine = self._held[holder] if holder is not None else 0
    tenants = self._evictable(client)
    if tenants is None:
      held = list(self._held.items())
    else:  # one holder is one tenant's
      tenant_of = {h: self._clients.get(s) for s, h in self._holders.items()}
      held = [(h, n) for h, n in self._held.items() if tenant_of.get(h) in tenants]
    most, count = max(held, key=lambda kv: kv[1], default=(None, 0))
    if most is not None and count > mine + 1:
      self._drop(self._oldest_of(most))
      return
    if mine:
      self._drop(self._oldest_of(holder))  # type: ignore[arg-type]  # mine > 0: not None
      return
    oldest, last = next(iter(self._last.items()))
    if now - last < self.evict_idle_s:
      raise errors.BusyError(
          f"this sidecar keeps {self.limit} handshake sessions (max_sessions), every one "
          f"used in the last {self.evict_idle_s:g} s and none held by a client that holds "
          "more than one; handshake again later, or raise max_sessions")
    self._drop(oldest)

  def tenant_limit(self, client: str | None) -> int:
    """The most sessions tenant ``client`` may hold: its quota (a pool file's
    ``sessions``, or its share by weight), else ``limit``."""
    quota = self._quota(client)
    return self.limit if quota is None else min(quota[0], self.limit)

  def holding(self, holders: Iterable[str]) -> set[str]:
    """Those of ``holders`` that hold a live session now."""
    with self._lock:
      return {h for h in holders if self._held[h] > 0}

  def _quota(self, client: str | None) -> tuple[int, str] | None:
    """Tenant ``client``'s most sessions, and what sets it; None: no quota."""
    if self._tenancy is None or client is None:
      return None
    t = self._tenancy.tenant(client)
    if t is None:
      return None
    limit = quotas_lib.SESSIONS.limit(t, self._tenancy.pool, total=self.limit)
    return None if limit is None else (limit.most, limit.why)

  def _make_room(self, client: str, quota: tuple[int, str], now: float) -> None:
    """Room for one more session of tenant ``client``: its oldest goes if idle long enough.

    Raises:
      ResourceExhaustedError: every one of its sessions was used recently.
    """
    mine = [s for s in self._last if self._clients.get(s) == client]  # oldest first
    if len(mine) < quota[0]:
      return
    oldest = mine[0]
    if now - self._last[oldest] < self.evict_idle_s:
      raise errors.ResourceExhaustedError(
          f"tenant {client!r} keeps {len(mine)} handshake sessions, its quota ({quota[1]}), "
          f"every one used in the last {self.evict_idle_s:g} s; close Controllers that are "
          "done, handshake again later, or raise its sessions quota in the pool file")
    self._drop(oldest)

  def revoke(self, client: str) -> int:
    """Drops every session of tenant ``client`` (removed from the pool); how many."""
    with self._lock:
      mine = [s for s in self._last if self._clients.get(s) == client]
      for s in mine:
        self._drop(s)
      return len(mine)

  def end(self, session: object) -> bool:
    """Ends ``session`` (its client left); whether it was live."""
    with self._lock:
      if not isinstance(session, str) or session not in self._last:
        return False
      self._forget(session)
      return True

  def count_of(self) -> dict[str, int]:
    """Live sessions per tenant."""
    with self._lock:
      out: dict[str, int] = {}
      for s in self._last:
        c = self._clients.get(s)
        if c is not None:
          out[c] = out.get(c, 0) + 1
      return out

  def last_used(self, client: str) -> float | None:
    """When a live session of tenant ``client`` was last used (the clock's time); None if
    it has none."""
    with self._lock:
      times = [t for s, t in self._last.items() if self._clients.get(s) == client]
    return max(times, default=None)

  def _drop(self, session: str) -> None:
    self._forget(session)
    self.expired += 1

  def _forget(self, session: str) -> None:
    del self._last[session]
    self._replica_links.discard(session)
    self._clients.pop(session, None)
    holder = self._holders.pop(session, None)
    if holder is not None:
      self._held[holder] -= 1
      if not self._held[holder]:
        del self._held[holder]

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

  def is_replica_link(self, session: object) -> bool:
    """Whether ``session`` is a live replica link of another sidecar's."""
    with self._lock:
      return isinstance(session, str) and session in self._replica_links

  def live(self, session: object) -> bool:
    """Whether ``session`` is live now (not refreshed: a check, not a use)."""
    with self._lock:
      last = self._last.get(session) if isinstance(session, str) else None
      return last is not None and self._clock() - last < self.idle_s

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
        f"{self.idle_s:g} s, or for {self.evict_idle_s:g} s and evicted by a newer one, or "
        f"evicted by newer ones of a client that made more than others or more than "
        f"{self.per_client} (max_sessions_per_client)); call Handshake first and send its "
        "session as metadata 'sidecar-session'")

  def __len__(self) -> int:
    with self._lock:
      return len(self._last)


def connection_of(remote: str) -> str | None:
  """The client a gRPC peer string names, as ``Sessions`` counts them: a TCP connection
  (``ipv4:127.0.0.1:50412``, address and port); None for a Unix socket's (``unix:``),
  where gRPC names no peer (its clients are the socket's owner and ``--socket-group``)."""
  return remote if remote.startswith(("ipv4:", "ipv6:")) else None


# Bytes of large inline requests (those with arrays left in their wire bytes) being decoded
# at once: each costs about its size again while its arrays are copied out, so together
# they cost at most this (one larger request still runs, alone).
INLINE_BYTES_IN_FLIGHT = 256 << 20


class InlineBytes:
  """At most ``limit`` bytes of large inline requests decoded at once; the others wait,
  within their deadline. With tenants, at most a tenant's ``inline_bytes`` of its own (the
  tenant a call runs for is ``tenants.CURRENT``)."""

  def __init__(self, limit: int = INLINE_BYTES_IN_FLIGHT, *,
               tenancy: tenants_lib.Tenancy | None = None):
    self.limit = limit
    self._tenancy = tenancy
    self._cv = threading.Condition()
    self._held = 0
    self._by_tenant: collections.Counter[str] = collections.Counter()

  @contextlib.contextmanager
  def hold(self, nbytes: int, timeout: float | None) -> Iterator[None]:
    """Holds ``nbytes`` of the budget while the block runs.

    Raises:
      BusyError: no room within ``timeout`` seconds (None: wait as long as it takes).
      ResourceExhaustedError: the request alone passes its tenant's ``inline_bytes``, or
        its tenant's others leave no room within ``timeout``.
    """
    name = tenants_lib.CURRENT.get()
    t = None if self._tenancy is None else self._tenancy.tenant(name)
    quota = None if t is None else quotas_lib.INLINE_BYTES.of(t)
    if t is not None and quota is not None and nbytes > quota:
      raise errors.ResourceExhaustedError(
          f"tenant {t.name!r} sent an inline request of {nbytes} bytes, more than its quota "
          f"(inline_bytes={quota}, {self._tenancy and self._tenancy.where(t.name)}); pass "
          "large arrays through a Worker's arena, or raise its quota in the pool file")
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cv:
      while ((self._held and self._held + nbytes > self.limit) or (
          t is not None and quota is not None and self._by_tenant[t.name] + nbytes > quota)):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          if t is not None and quota is not None and self._by_tenant[t.name] + nbytes > quota:
            raise errors.ResourceExhaustedError(
                f"tenant {t.name!r} is decoding {self._by_tenant[t.name]} bytes of inline "
                f"requests; {nbytes} more would pass its quota (inline_bytes={quota}); pass "
                "large arrays through a Worker's arena, or retry")
          raise errors.BusyError(
              f"this sidecar is decoding {self._held} bytes of inline requests, its limit "
              f"({self.limit}, limits.INLINE_BYTES_IN_FLIGHT); pass large arrays through a "
              "Worker's arena, or retry")
        self._cv.wait(left)
      self._held += nbytes
      if t is not None:
        self._by_tenant[t.name] += nbytes
    try:
      yield
    finally:
      with self._cv:
        self._held -= nbytes
        if t is not None:
          self._by_tenant[t.name] -= nbytes
        self._cv.notify_all()


@functools.cache
def _malloc_trim() -> Any:
  name = ctypes.util.find_library("c")
  return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def trim_heap() -> None:
  """Gives the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
  nothing). A large message's bytes freed stay in the process otherwise, counted in its
  RSS: gRPC hands a large request over as one bytes object made from the transport's
  slices, whose ~1x of freed chunks stayed under the copy the decoder then made (a 128 MiB
  call peaked at 3.6x its size, not 3x); each thread that answered a large inline Read
  kept its answer's chunks in its own heap (eight threads, 160 MiB for a 16 MiB shard)."""
  trim = _malloc_trim()
  if trim is not None:
    trim(0)
