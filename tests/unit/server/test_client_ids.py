"""Client ids (issue 42, gap d): the ticket that tells a Unix-socket client's process,
checked without trusting the client; and the ticket fetched in a handshake (issue 54,
item 3) for a client that cannot reach the abstract socket, and its bound."""

import os
import socket

import pytest

from sidecar._src.core import errors
from sidecar._src.server import client_ids, limits

pytestmark = pytest.mark.unit


def test_a_ticket_names_its_process_and_nothing_forged_does():
  tickets = client_ids.Tickets()
  ticket = tickets.issue(os.getpid())
  assert ticket is not None
  assert tickets.holder(ticket) == f"pid:{os.getpid()}"
  pid, start, mac = ticket.split(".")
  for forged in (f"{pid}.{start}.{'0' * len(mac)}",  # no mac of ours
                 f"{pid}.{int(start) + 1}.{mac}",  # a reused pid: another start time
                 f"1.{start}.{mac}",  # another process's pid
                 client_ids.Tickets().issue(os.getpid()),  # another sidecar's key
                 "garbage", None, 7, "1" * 200):
    assert tickets.holder(forged) == client_ids.ANONYMOUS, forged


def test_a_listener_tells_each_process_its_ticket_and_gives_way_where_the_name_is_taken():
  tickets = client_ids.Tickets()
  name = f"\0sidecar-client-ids-test-{os.getpid()}".encode()
  listener = client_ids.Listener(name, tickets)
  assert listener.start()
  try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
      sock.settimeout(10)
      sock.connect(name)
      told = sock.recv(200).decode()
    assert tickets.holder(told) == f"pid:{os.getpid()}"
    assert not client_ids.Listener(name, tickets).start()  # taken: no tickets, logged
  finally:
    listener.close()
    listener.close()  # idempotent


def test_tenants_never_share_a_holder():
  """Issue 54, attack 3: a tenant's ticketless clients, or its process's, hold apart from
  every other tenant's; with the one shared token, as before."""
  for ticketed in (client_ids.ANONYMOUS, f"pid:{os.getpid()}"):
    assert client_ids.held_by(ticketed, None) == ticketed
    assert client_ids.held_by(ticketed, "alice") != client_ids.held_by(ticketed, "bob")
    assert client_ids.held_by(ticketed, "alice") != ticketed
  assert client_ids.held_by(client_ids.ANONYMOUS, "bob") != client_ids.held_by("pid:1", "bob")


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def fetched_tickets(limit=8):
  """A Fetched over a real session table of ``limit`` sessions (its bound: half)."""
  clock = Clock()
  sessions = limits.Sessions(idle_s=1e6, limit=limit, per_client=limit, clock=clock)
  return client_ids.Fetched(sessions, idle_s=60.0, clock=clock), sessions, clock


def hold(sessions, holder, tenant):
  """A session of ``tenant`` held by a fetched ticket's ``holder``, as a handshake makes."""
  return sessions.new(client=tenant, holder=client_ids.held_by(holder, tenant))


def test_a_fetched_ticket_holds_for_its_tenant_only_and_nothing_forged_does():
  """Issue 54, item 3: a ticket told in the handshake, for a client the abstract socket
  cannot reach. It holds only with the tenant it was told to; a guessed number, a pasted
  MAC, another sidecar's or another tenant's ticket counts as none."""
  fetched, _, _ = fetched_tickets()
  ticket, holder = fetched.issue("alice")
  assert holder.startswith(client_ids.FETCHED)
  assert fetched.holder(ticket, "alice") == holder
  number, mac = ticket.split(".")
  bobs, _ = fetched.issue("bob")
  other, _ = fetched_tickets()[0].issue("alice")  # another sidecar's: same number, its key
  for forged, tenant in ((ticket, "bob"), (ticket, None), (bobs, "alice"),
                         (f"{number}.{'0' * len(mac)}", "alice"),
                         (f"{int(number) + 2}.{mac}", "alice"),  # a guessed number
                         (other, "alice"), ("garbage", "alice"), (None, "alice"),
                         (7, "alice"), ("1" * 200, "alice")):
    assert fetched.holder(forged, tenant) is None, (forged, tenant)
  assert client_ids.held_by(holder, "alice") != client_ids.held_by(holder, "bob")


def test_a_tenants_live_tickets_are_bounded_and_only_its_own_idle_ones_retire():
  """Half a tenant's sessions limit of live tickets (8 sessions: 4). Past it, the tenant's
  own ticket that held a session the longest ago goes if it holds none now, else the ask
  is refused; another tenant's tickets are never touched. A ticket without a session for
  idle_s is retired at its tenant's next ask."""
  fetched, sessions, clock = fetched_tickets(limit=8)
  assert fetched.bound("alice") == fetched.bound(None) == 4
  alice = [fetched.issue("alice") for _ in range(4)]
  held = [hold(sessions, holder, "alice") for _, holder in alice]
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"tenant 'alice' keep 4 tickets, each holding a live session"):
    fetched.issue("alice")
  bob = [fetched.issue("bob") for _ in range(4)]  # his own bound: alice's are not his room
  assert fetched.count_of() == {"alice": 4, "bob": 4}
  assert all(fetched.holder(t, "alice") for t, _ in alice)

  sessions.end(held[1])  # alice's second ticket holds no session now: it goes first
  clock.now += 1
  fifth, _ = fetched.issue("alice")
  assert fetched.holder(alice[1][0], "alice") is None
  assert [fetched.holder(t, "alice") is not None for t, _ in alice] == [True, False, True, True]
  assert fetched.holder(fifth, "alice") is not None

  clock.now += 60  # bob's tickets never held a session: retired at his next ask
  fetched.issue("bob")
  assert not any(fetched.holder(t, "bob") for t, _ in bob)
  assert fetched.count_of() == {"alice": 4, "bob": 1}
  assert fetched.revoke("alice") == 4 and fetched.count_of() == {"bob": 1}
