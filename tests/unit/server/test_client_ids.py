"""Client ids (issue 42, gap d): the ticket that tells a Unix-socket client's process,
checked without trusting the client."""

import os
import socket

import pytest

from sidecar._src.server import client_ids

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
