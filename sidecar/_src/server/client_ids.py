"""Which process a Unix-socket client is: what its handshake sessions count against.

Over TCP each connection holds its own sessions (``limits.peer_of``: address and port). gRPC
names no peer for a ``unix:`` connection, so the kernel is asked on a socket of our own:
beside a ``unix:`` gRPC socket the sidecar listens on an abstract socket named after that
socket file (``ipc.client_ids_name``), and answers each connection with a ticket for the
connecting process, whose pid the kernel gives (``SO_PEERCRED``). A handshake that
presents its ticket (``protocol.PID_TICKET_KEY``) counts against that process; one
without counts with every other Unix client that presented none. Each is counted within
its tenant (the client its token names, ``held_by``: ``unix:@bob``, ``pid:N@bob``). So one
process's flood of handshakes evicts its own sessions first, and one tenant's flood,
ticketless or with another's copied ticket, evicts only that tenant's (``limits.Sessions``;
issue 54's attack 3: bob's ticketless handshakes used to evict alice's ticketless session).

A ticket is ``pid.start.mac``: an HMAC, under a key of this sidecar's run, of the pid and
the process's start time, so it names only the process that asked for it and dies with
it (a reused pid has another start time). It grants nothing else: the handshake still
needs its token. A client asks for its ticket with ``ipc.fetch_ticket``.

A client that the abstract socket cannot reach (another network namespace, where the name
does not exist; the name taken by another process; a non-Python client) asks for a ticket
in its handshake instead (``HandshakeRequest.ticket``): :class:`Fetched` tells it one in
the answer, authenticated as the connection is (the tenant its token names), and holds
that handshake's session by it. Later handshakes present it (``protocol.TICKET_KEY``) with
the same tenant's token; forged, or with another tenant's token, it counts as no ticket.
A fetched ticket is ``n.mac``: a number of this sidecar's run and an HMAC of it and its
tenant, so neither a guessed number nor a ticket of another tenant holds. Unlike a pid
ticket it names no process, so the sidecar keeps each one, and bounds them (see
:class:`Fetched`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable

from sidecar._src.core import errors, procfs
from sidecar._src.server import limits
from sidecar._src.wire import ipc

log = logging.getLogger(__name__)

ANONYMOUS = "unix:"  # the holder of Unix-socket sessions with no ticket (no tenant named)
FETCHED = "ticket:"  # a fetched ticket's holder: ticket:N (of a tenant: ticket:N@bob)
FULL_RECHECK_S = 1.0  # at its bound, a tenant's tickets are looked over at most this often
_MAX_TICKET = ipc.MAX_TICKET


def held_by(ticketed: str, client: str | None) -> str:
  """The holder of a Unix-socket session: ``ticketed`` (:meth:`Tickets.holder`'s answer,
  a process or :data:`ANONYMOUS`) of tenant ``client`` (the client its token names; None:
  the one shared token's). Tenants never share a holder, so none evicts another's."""
  return ticketed if client is None else f"{ticketed}@{client}"


class Tickets:
  """Issues and checks the tickets of client processes (see the module's docstring)."""

  def __init__(self) -> None:
    self._key = secrets.token_bytes(32)

  def _mac(self, pid: int, start: int) -> str:
    return hmac.new(self._key, f"{pid}.{start}".encode(), hashlib.sha256).hexdigest()[:32]

  def issue(self, pid: int) -> str | None:
    start = procfs.start(pid)
    return None if start is None else f"{pid}.{start}.{self._mac(pid, start)}"

  def holder(self, ticket: object) -> str:
    """``pid:N`` for a valid ticket of a live process ``N``, else :data:`ANONYMOUS`."""
    if not isinstance(ticket, str) or len(ticket) > _MAX_TICKET:
      return ANONYMOUS
    try:
      pid_text, start_text, mac = ticket.split(".")
      pid, start = int(pid_text), int(start_text)
    except ValueError:
      return ANONYMOUS
    if procfs.start(pid) != start or not hmac.compare_digest(mac, self._mac(pid, start)):
      return ANONYMOUS
    return f"pid:{pid}"


class Fetched:
  """Tickets told in a handshake's answer (see the module's docstring), and their bound.

  A tenant keeps at most :meth:`bound` live tickets: half the most sessions it may hold
  (``Sessions.tenant_limit``: its ``sessions`` quota, its share by weight, or
  ``max_sessions``), so tickets that each hold one session fill at most half of them and
  the rest stays for holders that a full table makes room from. A ticket whose holder has
  held no live session for ``idle_s`` (``session_evict_s``) is retired when its tenant
  next asks (looked for once per ``idle_s``); at the bound the tenant's own ticket that
  held one the longest ago is retired first, if it holds none now; else the ask is
  refused, and asks within ``FULL_RECHECK_S`` of that look are refused without another
  (a look costs a pass over the tenant's tickets: a flood of asks at the bound pays one a
  second). Another tenant's tickets are never touched. A retired
  ticket counts as none, and a handshake that presents it and asks again gets a new one:
  nothing a client holds depends on one ticket living.
  """

  def __init__(self, sessions: limits.Sessions, *, idle_s: float,
               clock: Callable[[], float] = time.monotonic):
    self._sessions = sessions
    self.idle_s = idle_s
    self._clock = clock
    self._key = secrets.token_bytes(32)
    self._numbers = itertools.count(1)
    self._lock = threading.Lock()
    # Per tenant: its live tickets' numbers, and when each was last seen holding a session.
    self._kept: dict[str | None, dict[int, float]] = {}
    self._swept: dict[str | None, float] = {}  # per tenant: when its idle ones were looked for

  def _mac(self, number: int, tenant: str | None) -> str:
    # repr tells None (the one shared token) from a tenant named "None".
    return hmac.new(self._key, f"{number}.{tenant!r}".encode(),
                    hashlib.sha256).hexdigest()[:32]

  def bound(self, tenant: str | None) -> int:
    """The most live tickets ``tenant`` keeps (see the class docstring)."""
    return max(1, self._sessions.tenant_limit(tenant) // 2)

  def holder(self, ticket: object, tenant: str | None) -> str | None:
    """``ticket:N`` for a live ticket told to ``tenant``, else None (none, forged, retired,
    or another tenant's)."""
    if not isinstance(ticket, str) or len(ticket) > _MAX_TICKET:
      return None
    number_text, _, mac = ticket.partition(".")
    try:
      number = int(number_text)
    except ValueError:
      return None
    if not hmac.compare_digest(mac, self._mac(number, tenant)):
      return None
    with self._lock:
      mine = self._kept.get(tenant, {})
      if number not in mine:
        return None
      mine[number] = self._clock()  # about to hold a session
    return f"{FETCHED}{number}"

  def issue(self, tenant: str | None) -> tuple[str, str]:
    """A new ticket of ``tenant`` and its holder (``ticket:N``).

    Raises:
      ResourceExhaustedError: the tenant keeps its bound of tickets, each holding a live
        session (the message names the bound and what sets it).
    """
    bound = self.bound(tenant)
    with self._lock:
      now = self._clock()
      mine = self._kept.setdefault(tenant, {})
      since = now - self._swept.get(tenant, now)
      if since >= self.idle_s or (len(mine) >= bound and since >= FULL_RECHECK_S):
        self._retire(tenant, mine, now, bound)
      if len(mine) >= bound:
        raise errors.ResourceExhaustedError(self._full(tenant, bound))
      self._swept.setdefault(tenant, now)
      number = next(self._numbers)
      mine[number] = now
    return f"{number}.{self._mac(number, tenant)}", f"{FETCHED}{number}"

  def _retire(self, tenant: str | None, mine: dict[int, float], now: float,
              bound: int) -> None:
    """Retires ``tenant``'s tickets that held no session for ``idle_s``; at ``bound``, its
    one that held one the longest ago if it holds none now. One look at the sessions."""
    self._swept[tenant] = now
    holders = {self._held_by(n, tenant): n for n in mine}
    live = {holders[h] for h in self._sessions.holding(holders)}
    idle = {}
    for n, seen in list(mine.items()):
      if n in live:
        mine[n] = now
      elif now - seen >= self.idle_s:
        del mine[n]
      else:
        idle[n] = seen
    if len(mine) >= bound and idle:
      del mine[min(idle, key=idle.__getitem__)]

  @staticmethod
  def _held_by(number: int, tenant: str | None) -> str:
    return held_by(f"{FETCHED}{number}", tenant)

  def _full(self, tenant: str | None, bound: int) -> str:
    who = "this sidecar's clients" if tenant is None else f"tenant {tenant!r}"
    return (f"{who} keep {bound} tickets, each holding a live session: the most they keep "
            f"(half of {self._sessions.tenant_limit(tenant)}, the most sessions they may "
            "hold); close Controllers that are done, or handshake without asking for a "
            "ticket (HandshakeRequest.ticket)")

  def revoke(self, tenant: str) -> int:
    """Retires every ticket of ``tenant`` (removed from the pool); how many."""
    with self._lock:
      self._swept.pop(tenant, None)
      return len(self._kept.pop(tenant, {}))

  def count_of(self) -> dict[str | None, int]:
    """Live tickets per tenant."""
    with self._lock:
      return {tenant: len(mine) for tenant, mine in self._kept.items() if mine}


class Listener:
  """Answers each connection to the abstract socket ``name`` with its process's ticket.

  One thread, started by :meth:`start`, joined by :meth:`close` (idempotent). Where the
  name is taken (another process of this network namespace holds it), no ticket is told:
  every Unix client counts as :data:`ANONYMOUS`.
  """

  def __init__(self, name: bytes, tickets: Tickets):
    self.name = name
    self._tickets = tickets
    self._sock: socket.socket | None = None
    self._thread: threading.Thread | None = None

  def start(self) -> bool:
    """Listens; whether it could (False: the name is taken, logged)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      sock.bind(self.name)
      sock.listen(64)
    except OSError as e:
      sock.close()
      log.warning("no client ids for the gRPC socket (%s): every Unix client's handshakes "
                  "count as one client's", e)
      return False
    self._sock = sock
    self._thread = threading.Thread(target=self._serve, name="sidecar-client-ids",
                                    daemon=True)
    self._thread.start()
    return True

  def _serve(self) -> None:
    sock = self._sock
    assert sock is not None
    while True:
      try:
        conn, _ = sock.accept()
      except OSError:
        return  # closed
      with conn:
        conn.settimeout(1.0)
        with contextlib.suppress(OSError):
          ticket = self._tickets.issue(ipc.ucred_of(conn).pid)
          conn.sendall((ticket or "").encode())

  def close(self) -> None:
    sock, self._sock = self._sock, None
    if sock is not None:
      with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
      sock.close()
    thread, self._thread = self._thread, None
    if thread is not None:
      thread.join(timeout=5)
