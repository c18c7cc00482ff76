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
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import threading

from sidecar._src.wire import ipc

log = logging.getLogger(__name__)

ANONYMOUS = "unix:"  # the holder of Unix-socket sessions with no ticket (no tenant named)
_MAX_TICKET = ipc.MAX_TICKET


def held_by(ticketed: str, client: str | None) -> str:
  """The holder of a Unix-socket session: ``ticketed`` (:meth:`Tickets.holder`'s answer,
  a process or :data:`ANONYMOUS`) of tenant ``client`` (the client its token names; None:
  the one shared token's). Tenants never share a holder, so none evicts another's."""
  return ticketed if client is None else f"{ticketed}@{client}"


def start_time(pid: int) -> int | None:
  """The start time of process ``pid`` (clock ticks after boot, /proc); None if gone."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read()
  except OSError:
    return None
  fields = stat[stat.rfind(b")") + 2:].split()
  return int(fields[19]) if len(fields) > 19 else None  # field 22 of proc(5)


class Tickets:
  """Issues and checks the tickets of client processes (see the module's docstring)."""

  def __init__(self) -> None:
    self._key = secrets.token_bytes(32)

  def _mac(self, pid: int, start: int) -> str:
    return hmac.new(self._key, f"{pid}.{start}".encode(), hashlib.sha256).hexdigest()[:32]

  def issue(self, pid: int) -> str | None:
    start = start_time(pid)
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
    if start_time(pid) != start or not hmac.compare_digest(mac, self._mac(pid, start)):
      return ANONYMOUS
    return f"pid:{pid}"


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
