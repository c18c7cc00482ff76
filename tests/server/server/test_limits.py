"""The bounds of server/limits.py and the worker socket, and the attacks of issue 16 they stop.

Tier 1: StreamSlots, Sessions and Credits alone. Tier 2: one in-process sidecar, attacked
over raw gRPC and its Unix socket; after each attack it still serves a Controller.
"""

import concurrent.futures
import json
import os
import queue
import socket
import struct
import time

import grpc
import numpy as np
import pytest

import sidecar
from sidecar._src.core import errors
from sidecar._src.server.calls.credits import Credits
from sidecar._src.server.limits import MAX_PREFETCH, Sessions, StreamSlots
from sidecar._src.server.workers import workers as workers_lib
from sidecar._src.wire import codec, ipc, protocol
from sidecar._src.wire.protocol import pb
from tests.conftest import eventually
from tests.support.pool_files import ALICE, BOB, ROOMY_POOL, write_pool
from tests.support.raw_client import Raw, rejected

pytestmark = pytest.mark.server


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


# ---- tier 1 -----------------------------------------------------------------------------------


def test_stream_slots_bound_all_streams_and_those_of_one_session():
  slots = StreamSlots(total=3, per_session=2)
  with slots.hold("a"), slots.hold("a"):
    with pytest.raises(errors.BusyError, match=r"max_streams_per_session=2"):
      with slots.hold("a"):
        pass
    with slots.hold("b"):
      with pytest.raises(errors.BusyError, match=r"its limit \(max_streams=3\)"):
        with slots.hold("c"):
          pass
      assert slots.running == 3
  assert slots.running == 0
  with slots.hold("a"), slots.hold("a"), slots.hold("b"):
    pass  # every slot came back


def test_sessions_expire_when_unused_and_every_use_refreshes():
  clock = Clock()
  sessions = Sessions(idle_s=10, limit=100, clock=clock)
  a, b = sessions.new(), sessions.new()
  clock.now = 9
  sessions.use(a)
  clock.now = 15
  sessions.use(a)  # used at 9: alive
  with pytest.raises(errors.SessionLostError, match=r"unused for 10 s.*call Handshake first"):
    sessions.use(b)
  assert len(sessions) == 1 and sessions.expired == 1
  for bad in (None, "", "c-guess", b"bytes", 5):
    with pytest.raises(errors.SessionLostError, match="no live handshake session"):
      sessions.use(bad)
    assert not sessions.touch(bad)
  clock.now = 24
  assert sessions.touch(a)  # as Status does for a watching controller
  clock.now = 33
  sessions.use(a)


def test_a_flood_of_handshakes_evicts_only_sessions_unused_for_a_while():
  clock = Clock()
  sessions = Sessions(idle_s=1e9, limit=3, evict_idle_s=60, clock=clock)
  first, second = sessions.new(), sessions.new()
  sessions.new()
  clock.now = 30
  sessions.use(first)
  with pytest.raises(errors.BusyError, match=r"keeps 3 handshake sessions \(max_sessions\), "
                     "every one used in the last 60 s"):
    sessions.new()  # none unused for 60 s: the flood is refused, nobody evicted
  clock.now = 61
  sessions.new()  # the least recently used, unused for 61 s, goes
  assert len(sessions) == 3
  sessions.use(first)
  with pytest.raises(errors.SessionLostError):
    sessions.use(second)


def test_a_clients_flood_evicts_its_own_sessions_never_anothers_in_use():
  """Issue 42: one client's 4,200 handshakes locked every new client out for 60 s. A
  client (its connection) keeps at most ``per_client``, its own oldest going; a full
  table makes room from the client holding the most."""
  clock = Clock()
  sessions = Sessions(idle_s=1e9, limit=8, evict_idle_s=60, clock=clock, per_client=4)
  alice = sessions.new(holder="ipv4:127.0.0.1:1000")
  flood = [sessions.new(holder="ipv4:127.0.0.1:2000") for _ in range(100)]  # none refused
  for s in flood[-4:] + [alice]:
    sessions.use(s)
  with pytest.raises(errors.SessionLostError, match="max_sessions_per_client"):
    sessions.use(flood[-5])
  bob = [sessions.new(holder="ipv4:127.0.0.1:3000") for _ in range(3)]  # the table is full
  carol = sessions.new(holder="ipv4:127.0.0.1:4000")  # the flood's oldest made room
  assert len(sessions) == 8
  for s in (alice, carol, *bob, *flood[-3:]):
    sessions.use(s)
  with pytest.raises(errors.SessionLostError):
    sessions.use(flood[-4])
  # Clients of one session each, all used within evict_idle_s: the new one waits.
  few = Sessions(idle_s=1e9, limit=2, evict_idle_s=60, clock=clock, per_client=4)
  few.new(holder="ipv4:127.0.0.1:1000")
  few.new()  # a Unix socket's: no holder
  with pytest.raises(errors.BusyError, match="none held by a client that holds more than one"):
    few.new(holder="ipv4:127.0.0.1:2000")


def test_credits_beyond_the_prefetch_are_ignored():
  credits = Credits(2)
  credits.grant(1 << 40)
  assert credits.take() and credits.take()
  credits.close()
  assert not credits.take()  # a third would have needed a credit the consumer never owed


def test_credits_granted_before_a_half_close_are_still_taken_but_not_after_a_close():
  credits = Credits(3)
  credits.finish()  # the consumer sent its credits and closed its side of the stream
  assert [credits.take() for _ in range(4)] == [True, True, True, False]  # never blocks
  gone = Credits(3)
  gone.close()  # the consumer went away: what it had credited is not sent
  assert not gone.take()


# ---- tier 2: gRPC -----------------------------------------------------------------------------


class Starver:
  """Streams that take their first item and then never send a credit."""

  def __init__(self, raw: Raw):
    self._raw = raw
    self._queues: list[queue.SimpleQueue] = []
    self.calls: list = []

  def open(self) -> grpc.RpcError | None:
    """Opens one; returns the error it met, or None once its first item came."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    request = pb.CallRequest(name="echo_items", args=codec.encode((1, 1000)),
                             kwargs=codec.encode({}))
    q.put(pb.StreamRequest(start=request, prefetch=1))
    call = self._raw._stream(iter(q.get, None), metadata=self._raw.metadata, timeout=60)
    self._queues.append(q)
    self.calls.append(call)
    try:
      next(call)
    except grpc.RpcError as e:
      return e
    return None

  def close(self):
    for q, call in zip(self._queues, self.calls):
      q.put(None)
      call.cancel()


def test_streams_that_never_send_a_credit_starve_nobody(make_server):
  server = make_server()  # defaults: 32 threads, 16 streams, 8 per session
  raws = [Raw(server.port) for _ in range(4)]
  starvers = [Starver(r) for r in raws]
  try:
    errors_a = [starvers[0].open() for _ in range(9)]
    assert errors_a[:8] == [None] * 8
    assert errors_a[8].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_streams_per_session=8" in errors_a[8].details()
    errors_b = [s.open() for s in starvers[1:] for _ in range(8)]  # 32 streams tried in all
    assert errors_b[:8] == [None] * 8 and all(
        e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "its limit (max_streams=16)"
        in e.details() for e in errors_b[8:])
    # With 16 streams holding their threads: a new controller's handshake, calls, status.
    with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], connect_timeout=10,
                            timeout=10) as ctl:
      assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
      assert ctl.status()[0].workers == 1
      starvers[0].close()  # its 8 slots come back
      with ctl.stream("echo_items", args=(7, 3)) as s:
        assert list(s) == [7, 7, 7]
  finally:
    for s in starvers:
      s.close()
    for r in raws:
      r.close()


def test_a_prefetch_past_the_limit_is_invalid_argument(make_server):
  server = make_server()
  raw = Raw(server.port)
  request = pb.CallRequest(name="echo_items", args=codec.encode((1, 3)), kwargs=codec.encode({}))
  e = rejected(lambda: list(raw._stream(iter([pb.StreamRequest(
      start=request, prefetch=MAX_PREFETCH + 1)]), metadata=raw.metadata, timeout=10)))
  assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert f"prefetch must be at most {MAX_PREFETCH}" in e.details()
  raw.close()


def test_sessions_evicted_by_a_flood_of_handshakes_must_handshake_again(make_server):
  server = make_server(max_sessions=2, session_evict_s=0.2)
  first = Raw(server.port)
  time.sleep(0.3)  # unused long enough to be evicted
  others = [Raw(server.port) for _ in range(2)]
  e = rejected(lambda: first.call("add", pb.Value(int_value=1)))
  assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
  assert e.details().startswith("SessionLostError: no live handshake session")
  assert "call Handshake first" in e.details()
  assert codec.decode(others[1].call("add", pb.Value(int_value=1))) == 1
  for r in (first, *others):
    r.close()


def test_a_handshake_flood_evicts_no_live_session_and_a_controller_handshakes_again(
    make_server, tmp_path):
  """4,200 handshakes used to push a live controller's session out for good (every later
  call: VersionMismatchError), then (issue 42) to be refused while the session was in
  use, locking every new client out. Now the flood evicts its own sessions, and a session
  the sidecar dropped is made again by the Controller itself, for a call, a checkpoint rpc
  or a stream."""
  live = make_server(max_sessions=64)  # session_evict_s: 60 s, longer than the flood
  with sidecar.jax.Controller([f"127.0.0.1:{live.port}"], timeout=10) as ctl:
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
    session = ctl._sidecars.conns[0].metadata
    flood = Raw(live.port)
    handshake = flood.channel.unary_unary(
        f"/{protocol.SERVICE}/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString)
    for _ in range(200):  # none refused: the flood's own oldest sessions make room
      handshake(pb.HandshakeRequest(versions=protocol.local_versions()), timeout=10)
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]  # still its own session
    assert ctl._sidecars.conns[0].metadata == session
    flood.close()
  quick = make_server(max_sessions=64)
  # Not attached: its calls go over gRPC, in its session (a Worker's go over its socket).
  with sidecar.jax.Controller([f"127.0.0.1:{quick.port}"], timeout=10, attach=False) as ctl:

    def evicted() -> None:
      """Its session dropped by the sidecar (as one idle for session_idle_s is), a
      second after the last renewal (one renewal serves the calls of a second)."""
      time.sleep(1.1)
      assert quick.sessions.end(dict(ctl._sidecars.conns[0].metadata)[protocol.SESSION_KEY])

    session = ctl._sidecars.conns[0].metadata
    evicted()
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]  # handshook again, by itself
    assert ctl._sidecars.conns[0].metadata != session
    evicted()
    (future,) = ctl.call_async("add", args=(2,), kwargs={"b": 3})
    assert future.result(10) == 5
    evicted()
    opened = ctl.checkpoint_client().open(0, str(tmp_path / "ck"), ram_steps=1,
                                           ram_budget=None, sweep=True)
    assert opened.result(timeout=10) == []  # a checkpoint rpc too
    # A stream over gRPC too (a controller that maps no arena; a Worker's stream, over
    # its socket, needs no handshake session).
    session = ctl._sidecars.conns[0].metadata
    evicted()
    with ctl.stream("echo_items", args=(7, 3), timeout=10) as s:
      assert list(s) == [7, 7, 7]
    assert ctl._sidecars.conns[0].metadata != session


def test_a_flood_of_handshakes_over_one_or_several_connections_locks_no_client_out(
    make_server):
  """Issue 42: with one shared token, a client's 4,200 handshakes made every new client's
  refused for 60 s (BusyError, max_sessions). Now a connection keeps at most
  max_sessions_per_client, and a full table is made room in by the biggest holder."""
  server = make_server(token="t", max_sessions=128, max_sessions_per_client=32)
  target, auth = f"127.0.0.1:{server.port}", [(protocol.AUTH_KEY, "Bearer t")]
  request = pb.HandshakeRequest(versions=protocol.local_versions(), client="flood")
  channels = [grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(5)]  # a connection each
  try:
    for i, channel in enumerate(channels):
      handshake = channel.unary_unary(
          f"/{protocol.SERVICE}/Handshake",
          request_serializer=pb.HandshakeRequest.SerializeToString)
      for _ in range(600 if i == 0 else 40):  # none refused; 4 x 32 fill the table
        handshake(request, metadata=auth, timeout=10)
    assert len(server.sessions) == 128
    with sidecar.jax.Controller([target], token="t", timeout=10, attach=False) as ctl:
      assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
  finally:
    for channel in channels:
      channel.close()


def test_a_unix_clients_flood_evicts_its_own_sessions_by_process(make_server, tmp_path):
  """Issue 42's gap (d): over a ``unix:`` socket gRPC names no peer, so every Unix client's
  sessions were one holder's: a flood of 200 handshakes filled the table and every new
  handshake was refused (BusyError, max_sessions). Now a process that presents its ticket
  (the kernel's SO_PEERCRED pid, told on the socket beside) holds its own sessions;
  handshakes without one, or with a forged one, hold theirs together: a flood evicts only
  its own, and the Controller's session and a new Controller's handshake go through."""
  path = tmp_path / "g.sock"
  server = make_server(listen=f"unix:{path}", token="t", max_sessions=48,
                       max_sessions_per_client=16)
  with sidecar.jax.Controller([f"unix:{path}"], token="t", timeout=10, attach=False) as ctl, \
      ipc.Pinned(str(path), timeout=10) as pin:
    mine = dict(ctl._sidecars.conns[0].metadata)[protocol.SESSION_KEY]
    channel = grpc.insecure_channel(pin.target, options=ipc.PINNED_CHANNEL_OPTIONS)
    handshake = channel.unary_unary(f"/{protocol.SERVICE}/Handshake",
                                    request_serializer=pb.HandshakeRequest.SerializeToString)
    request = pb.HandshakeRequest(versions=protocol.local_versions(), client="flood")
    auth = ((protocol.AUTH_KEY, "Bearer t"),)
    try:
      for _ in range(100):
        handshake(request, metadata=auth, timeout=10)  # none refused
      assert server.sessions.touch(mine)  # the Controller's (its process's) was kept
      assert len(server.sessions) == 1 + 16
      assert server.fetched.count_of() == {}  # with its pid ticket it asked for no other
      with sidecar.jax.Controller([f"unix:{path}"], token="t", timeout=10, attach=False) as other:
        assert other.call("add", args=(2,), kwargs={"b": 3}) == [5]
      ticket = ipc.fetch_ticket(pin, timeout=10)
      assert ticket is not None and ticket.startswith(f"{os.getpid()}.")
      forged = ticket.rsplit(".", 1)[0] + ".0"  # no mac of this sidecar's: as no ticket
      for _ in range(100):
        handshake(request, metadata=auth + ((protocol.PID_TICKET_KEY, forged),), timeout=10)
      assert server.sessions.touch(mine)
      for _ in range(100):  # this process's own flood, with its ticket: its own oldest go
        handshake(request, metadata=auth + ((protocol.PID_TICKET_KEY, ticket),), timeout=10)
      assert len(server.sessions) <= 16 + 16
    finally:
      channel.close()
    assert ctl.call("add", args=(1,), kwargs={"b": 1}) == [2]


# Issue 54's attack 3: bob's sessions quota leaves room for his flood; a Unix client's
# holder (max_sessions_per_client=16) is what bounds it.
FLOOD_POOL = """\
tenants:
  - name: alice
    token_file: alice.token
    sessions: 8
    checkpoint_roots: [alice]
  - name: bob
    token_file: bob.token
    sessions: 48
    checkpoint_roots: [bob]
"""


def test_a_tenants_ticketless_flood_evicts_only_its_own_sessions(make_server, tmp_path):
  """Issue 54, attack 3: every Unix client that presented no ticket (a non-Python client,
  another network namespace, an older client) was one holder, whatever its tenant: bob's
  ticketless handshakes, within his own sessions quota, evicted alice's live ticketless
  session (SessionLostError), and a save in flight with it. Now a tenant's ticketless
  clients hold their sessions together, apart from every other tenant's: bob's flood
  evicts bob's own oldest. So does a flood that presents a ticket bob copied from alice's
  process: it holds bob's sessions of that process, not alice's."""
  path = tmp_path / "g.sock"
  server = make_server(pool=write_pool(tmp_path, FLOOD_POOL), listen=f"unix:{path}",
                       max_sessions=64, max_sessions_per_client=16)
  channel = grpc.insecure_channel(f"unix:{path}")  # no ticket: as a non-Python client
  handshake = channel.unary_unary(f"/{protocol.SERVICE}/Handshake",
                                  request_serializer=pb.HandshakeRequest.SerializeToString,
                                  response_deserializer=pb.HandshakeResponse.FromString)
  call = channel.unary_unary(f"/{protocol.SERVICE}/Call",
                             request_serializer=pb.CallRequest.SerializeToString,
                             response_deserializer=pb.CallResponse.FromString)
  request = pb.HandshakeRequest(versions=protocol.local_versions(), client="ticketless")

  def auth(token):
    return ((protocol.AUTH_KEY, f"Bearer {token}"),)

  def session(token, *extra):
    reply = handshake(request, metadata=auth(token) + extra, timeout=10)
    assert reply.tenant == ("alice" if token == ALICE else "bob")
    return reply.session

  def add(token, session):
    return codec.decode(call(pb.CallRequest(
        name="add", args=codec.encode((2,)), kwargs=codec.encode({"b": 3})),
        metadata=auth(token) + ((protocol.SESSION_KEY, session),), timeout=10).result)

  try:
    alice = session(ALICE)
    bob = [session(BOB) for _ in range(40)]  # more than a holder keeps; none refused
    assert add(ALICE, alice) == 5  # alice's session lives
    for s in bob[-16:]:  # bob's newest 16 live; his oldest were the ones evicted
      assert server.sessions.touch(s)
    assert not any(server.sessions.touch(s) for s in bob[:-16])
    e = rejected(lambda: add(BOB, bob[0]))
    assert e.details().startswith("SessionLostError: no live handshake session")
    assert server.sessions.count_of() == {"alice": 1, "bob": 16}
    # A ticket copied from alice's process, presented with bob's token: bob's own holder.
    with ipc.Pinned(str(path), timeout=10) as pin:
      ticket = ipc.fetch_ticket(pin, timeout=10)
    assert ticket is not None
    mine = ((protocol.PID_TICKET_KEY, ticket),)
    alice_ticketed = session(ALICE, *mine)
    for _ in range(40):
      session(BOB, *mine)
    assert add(ALICE, alice_ticketed) == 5 and add(ALICE, alice) == 5
    assert server.sessions.count_of() == {"alice": 2, "bob": 32}
  finally:
    channel.close()


class UnixRaw:
  """Raw handshakes and calls over a sidecar's ``unix:`` socket, as a non-Python client
  makes them: no pid ticket, and a fetched one only where asked for."""

  def __init__(self, path):
    self.channel = grpc.insecure_channel(f"unix:{path}")
    self._handshake = self.channel.unary_unary(
        f"/{protocol.SERVICE}/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString,
        response_deserializer=pb.HandshakeResponse.FromString)
    self._call = self.channel.unary_unary(
        f"/{protocol.SERVICE}/Call", request_serializer=pb.CallRequest.SerializeToString,
        response_deserializer=pb.CallResponse.FromString)

  def handshake(self, token, *, ticket=None, ask=False) -> pb.HandshakeResponse:
    metadata = ((protocol.AUTH_KEY, f"Bearer {token}"),)
    if ticket is not None:
      metadata += ((protocol.TICKET_KEY, ticket),)
    return self._handshake(pb.HandshakeRequest(versions=protocol.local_versions(),
                                               client="raw", ticket=ask),
                           metadata=metadata, timeout=10)

  def add(self, token, session) -> int:
    return codec.decode(self._call(
        pb.CallRequest(name="add", args=codec.encode((2,)), kwargs=codec.encode({"b": 3})),
        metadata=((protocol.AUTH_KEY, f"Bearer {token}"), (protocol.SESSION_KEY, session)),
        timeout=10).result)

  def close(self):
    self.channel.close()


def test_a_fetched_ticket_keeps_a_controllers_session_through_ticketless_floods(
    make_server, tmp_path):
  """Issue 54, item 3: a client that cannot reach the abstract socket (here closed: as
  from another network namespace, where its name does not exist) had no ticket, and its
  session was held with every ticketless client of its tenant: a flood of theirs evicted
  it. Now its Controller asks for a ticket in the handshake and its sessions are that
  ticket's: 1,100 ticketless handshakes of its own tenant, 1,100 of another's, and 1,100
  more presenting a forged ticket or one copied from the other tenant evict none of them
  (the ticketless session of its tenant made before them is evicted, as before)."""
  path = tmp_path / "g.sock"
  server = make_server(pool=write_pool(tmp_path, ROOMY_POOL), listen=f"unix:{path}",
                       max_sessions=160, max_sessions_per_client=16)
  server._client_ids.close()  # the abstract name unreachable: no pid ticket is told
  raw = UnixRaw(path)
  try:
    with sidecar.jax.Controller([f"unix:{path}"], token=ALICE, timeout=10,
                                attach=False) as ctl:
      mine = dict(ctl._sidecars.conns[0].metadata)[protocol.SESSION_KEY]
      assert server.fetched.count_of() == {"alice": 1}
      ticketless = raw.handshake(ALICE).session
      assert raw.handshake(ALICE).ticket == ""  # one that does not ask is told none
      bobs = raw.handshake(BOB, ask=True).ticket
      number = bobs.split(".")[0]
      for token, ticket in ((ALICE, None), (BOB, None), (ALICE, bobs),
                            (ALICE, f"{number}.{'0' * 32}")):
        for _ in range(1100 if ticket is None else 550):
          assert raw.handshake(token, ticket=ticket).ticket == ""  # none refused, none held
      assert server.sessions.touch(mine)
      assert not server.sessions.touch(ticketless)  # the ticketless flood's own holder
      assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
      assert dict(ctl._sidecars.conns[0].metadata)[protocol.SESSION_KEY] == mine  # no renew
      counts = server.sessions.count_of()
      assert counts["alice"] <= 1 + 16 + 16 and counts["bob"] <= 16 + 1
    assert server.fetched.count_of() == {"alice": 1, "bob": 1}
  finally:
    raw.close()


def rejected_or(fn) -> list:
  """``[fn()]``, or ``[]`` where it is refused as RESOURCE_EXHAUSTED."""
  try:
    return [fn()]
  except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
    return []


def test_a_tenants_fetched_tickets_are_bounded_and_never_take_anothers(make_server, tmp_path):
  """Half a tenant's sessions quota of live tickets (alice's 8: 4). Past it, asking is
  RESOURCE_EXHAUSTED naming the bound while each holds a live session; one whose session
  ended makes room (the bound is looked over again at most once a second), and a
  handshake presenting that retired ticket and asking gets a new one. bob's asks are his
  own: alice's bound never takes his, nor his hers."""
  path = tmp_path / "g.sock"
  server = make_server(pool=write_pool(tmp_path, FLOOD_POOL), listen=f"unix:{path}",
                       max_sessions=64, max_sessions_per_client=16)
  server._client_ids.close()
  raw = UnixRaw(path)
  leave = raw.channel.unary_unary(f"/{protocol.SERVICE}/Leave",
                                  request_serializer=pb.LeaveRequest.SerializeToString,
                                  response_deserializer=pb.LeaveResponse.FromString)
  try:
    alice = [raw.handshake(ALICE, ask=True) for _ in range(4)]
    assert len({r.ticket for r in alice}) == 4
    e = rejected(lambda: raw.handshake(ALICE, ask=True))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'alice' keep 4 tickets, each holding a live session" in e.details()
    bob = [raw.handshake(BOB, ask=True).ticket for _ in range(24)]  # his: half of 48
    assert rejected(lambda: raw.handshake(BOB, ask=True)).code() == (
        grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert all(raw.add(ALICE, r.session) == 5 for r in alice)
    # A ticket presented again holds: told back, and no new one counted.
    assert raw.handshake(ALICE, ticket=alice[0].ticket, ask=True).ticket == alice[0].ticket

    def leave_(session):
      leave(pb.LeaveRequest(), metadata=((protocol.AUTH_KEY, f"Bearer {ALICE}"),
                                         (protocol.SESSION_KEY, session)), timeout=10)

    def ask(**kw):
      """A new ticket once the bound is looked over again (at most once a second)."""
      told = []
      eventually(lambda: told or told.extend(rejected_or(lambda: raw.handshake(
          ALICE, ask=True, **kw).ticket)))
      return told[0]

    leave_(alice[1].session)
    fifth = ask()  # alice[1]'s ticket holds no session now: it goes
    assert raw.handshake(ALICE, ticket=alice[1].ticket).ticket == ""  # retired: as none
    leave_(alice[2].session)
    again = ask(ticket=alice[1].ticket)  # a new one instead
    assert again not in ("", alice[1].ticket, alice[2].ticket, fifth)
    assert server.fetched.count_of() == {"alice": 4, "bob": 24}
    assert raw.handshake(BOB, ticket=bob[0], ask=True).ticket == bob[0]
  finally:
    raw.close()


# ---- tier 2: the worker socket ----------------------------------------------------------------


def connect(server) -> socket.socket:
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.settimeout(10)
  sock.connect(server.options.socket_path)
  return sock


def attach(server) -> socket.socket:
  sock = connect(server)
  ipc.send(sock, {"op": "attach", "pid": 1,
                  "versions": protocol.versions_dict(protocol.local_versions())})
  reply, fds = ipc.recv(sock, max_fds=1)
  for fd in fds:
    socket.close(fd)
  assert "session" in reply, reply
  return sock


def frame(data: bytes) -> bytes:
  return struct.pack("<I", len(data)) + data


def still_serves(server) -> None:
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl:
    big = np.arange(1 << 14, dtype=np.float32)
    np.testing.assert_array_equal(ctl.call("echo", args=(big,))[0], big)  # through the arena


@pytest.mark.parametrize("data,match", [
    (json.dumps({"op": "free", "blocks": 5}).encode(), "'blocks' must be a list of"),
    (json.dumps({"op": "free", "blocks": [[1, "x"]]}).encode(), "'blocks' must be a list of"),
    (b'{"op": "\xff\xfe"}', "malformed control message: UnicodeDecodeError"),
    (b"[" * 100_000, "malformed control message"),
    (b"\x00garbage", "malformed control message"),
    (b"[1, 2]", "control message must be an object"),
    (json.dumps({"op": "alloc", "nbytes": 64, "timeout": float("nan")}).encode(),
     "malformed alloc request"),
    (json.dumps({"op": "alloc", "nbytes": "many"}).encode(), "malformed alloc request"),
    (json.dumps({"op": "alloc", "sizes": 64}).encode(), "sizes must be a list of 1 to"),
    (json.dumps({"op": "alloc", "sizes": [64] * 10_000}).encode(), "sizes must be a list of"),
    (json.dumps({"op": "alloc", "sizes": [64, -1]}).encode(), "nbytes must be positive"),
    (json.dumps({"op": "steal"}).encode(), "unknown op 'steal'"),
], ids=["blocks-int", "blocks-str", "utf8", "deep", "garbage", "list", "nan-timeout",
        "nbytes-str", "sizes-int", "sizes-many", "sizes-negative", "unknown-op"])
def test_every_malformed_frame_is_answered(make_server, data, match):
  server = make_server()
  sock = attach(server)
  sock.sendall(frame(data))
  reply, _ = ipc.recv(sock)
  assert (reply["error"]["type"].endswith("InvalidArgumentError")
          and match in reply["error"]["message"]), reply
  sock.close()
  still_serves(server)


def test_worker_socket_connections_are_capped(make_server):
  server = make_server(max_worker_connections=3)
  # Every place an attached worker's (a silent one gives way to a new connection:
  # test_port_floods.py::test_silent_connections_keep_no_worker_out_of_the_worker_socket)
  held = [attach(server), attach(server), attach(server)]
  refused = connect(server)
  reply, _ = ipc.recv(refused)
  assert reply["error"]["type"].endswith("ResourceExhaustedError")
  assert "max_worker_connections" in reply["error"]["message"]
  refused.close()
  held.pop().close()  # a slot comes back once its thread saw the close

  attached = []

  def attaches():
    if not attached:
      try:
        with sidecar.jax.Worker(server.options.socket_path, timeout=10) as w:
          attached.append(float(w.put(np.ones(8))[0].sum()))
      except sidecar.ResourceExhaustedError:
        pass
    return attached == [8.0]
  assert eventually(attaches)
  for s in held:
    s.close()


def test_a_connection_that_says_nothing_is_closed(make_server, monkeypatch):
  monkeypatch.setattr(workers_lib, "FIRST_FRAME_S", 0.2)
  server = make_server()
  sock = connect(server)
  assert sock.recv(1) == b""  # closed by the sidecar, not by a timeout here (10 s)
  sock.close()


def test_a_feed_batch_too_big_for_the_arena_fails_before_its_rows_are_read(make_server):
  """10 million rows of 16 B would be read (minutes, GiBs) before the 8 MiB arena said no."""
  from sidecar._src.user import registry as registry_lib
  from tests.support import feed_fns  # noqa: F401  (registers into the default registry)
  reg = registry_lib.Registry()
  for entry in sidecar.default_registry():
    if entry.fn.__module__ == "tests.support.feed_fns":
      reg.add(entry.kind, entry.name, entry.fn)
  raw = Raw(make_server(registry=reg).port)
  rows = 10_000_000
  request = pb.CallRequest(name="ids", args=codec.encode(()), kwargs=codec.encode({"n": rows}),
                           feed=pb.FeedSpec(global_batch_size=rows, shard_count=1,
                                            rows=[pb.RowRange(start=0, stop=rows)]))
  e = rejected(lambda: list(raw._stream(iter([pb.StreamRequest(start=request, prefetch=1)]),
                                        metadata=raw.metadata, timeout=30)))
  assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert "one batch of this host's rows takes 228.9 MiB of the arena (2 blocks: one per leaf " \
      "and row range), and can never fit: the arena is 8.0 MiB. One batch needs --shm-size " \
      "229MiB" in e.details()
  raw.close()


# ---- tier 2: slow calls -----------------------------------------------------------------------


def test_slow_calls_of_one_session_starve_neither_handshakes_nor_other_sessions(make_server):
  from tests.support import sidecar_fns
  server = make_server(threads=4, max_streams=1)  # 5 RPC threads; calls 3, one session 2
  attacker, other = Raw(server.port), Raw(server.port)
  gate = pb.CallRequest(name="wait_gate", args=codec.encode(("calls",)), kwargs=codec.encode({}))
  calls = [attacker._call.future(gate, metadata=attacker.metadata, timeout=60) for _ in range(6)]
  try:
    assert eventually(lambda: sum(c.done() for c in calls) == 4 and
                      sidecar_fns.waiting("calls") == 2, timeout=10)
    for c in (c for c in calls if c.done()):
      assert c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
      assert "the limit of one session (half of threads=4: 2)" in c.details(), c.details()
    # Another session's call runs; handshakes and status get a thread.
    third = other._call.future(gate, metadata=other.metadata, timeout=60)
    assert eventually(lambda: sidecar_fns.waiting("calls") == 3, timeout=10)
    with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], connect_timeout=10,
                            timeout=10) as ctl:
      assert ctl.status()[0].identity.host_id == 0
      # Every call thread is taken now: a fourth is told so at once, not queued.
      with pytest.raises(sidecar.ResourceExhaustedError,
                         match=r"runs 3 calls, its limit \(all but an eighth of threads=4\)"):
        ctl.call("add", args=(2,), kwargs={"b": 3})
      sidecar_fns.open_gate("calls")
      assert [c.result().result for c in calls if c.code() == grpc.StatusCode.OK] == [
          codec.encode(True)] * 2 and third.result().result == codec.encode(True)
      assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]  # every slot came back
  finally:
    sidecar_fns.open_gate("calls")
    attacker.close()
    other.close()


def test_many_calls_at_once_from_one_controller_queue_instead_of_being_refused(make_server):
  import time

  from sidecar._src.controller.connection import CALLS_IN_FLIGHT
  from tests.support import sidecar_fns
  server = make_server()  # 32 threads: one session may run 16 calls, then is refused
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], connect_timeout=10,
                          timeout=30) as ctl:
    try:
      futures = [ctl.call_async("wait_gate", args=("window",))[0] for _ in range(40)]
      assert eventually(lambda: sidecar_fns.waiting("window") == CALLS_IN_FLIGHT, timeout=10)
      time.sleep(0.2)
      assert sidecar_fns.waiting("window") == CALLS_IN_FLIGHT  # the rest wait here
      assert not any(f.done() for f in futures)
    finally:
      sidecar_fns.open_gate("window")
    assert [f.result(timeout=30) for f in futures] == [True] * 40
    # A call whose timeout passes while it waits its turn says so.
    sidecar_fns._gates.pop("late", None)
    blockers = [ctl.call_async("wait_gate", args=("late", 5.0))[0]
                for _ in range(CALLS_IN_FLIGHT)]
    with pytest.raises(sidecar.DeadlineExceededError, match="behind this controller's other"):
      ctl.call("add", args=(2,), timeout=0.5)
    queued = ctl.call_async("add", args=(2,), timeout=0.5)[0]
    with pytest.raises(sidecar.DeadlineExceededError, match="behind this controller's other"):
      queued.result(timeout=3)  # at its deadline, while the calls ahead still run
    sidecar_fns.open_gate("late")
    assert [f.result(timeout=30) for f in blockers] == [True] * CALLS_IN_FLIGHT
    # Calls still queued when the controller closes end with ClosedError, none hangs.
    sidecar_fns._gates.pop("closing", None)
    running = [ctl.call_async("wait_gate", args=("closing", 5.0))[0]
               for _ in range(CALLS_IN_FLIGHT)]
    waiting = ctl.call_async("add", args=(2,))[0]
    ctl.close()
    with pytest.raises(sidecar.ClosedError):
      waiting.result(timeout=3)
    sidecar_fns.open_gate("closing")
    for f in running:
      f.exception(timeout=10)  # ended one way or another


def test_many_threads_calling_one_host_at_once_queue_instead_of_being_refused(make_server):
  import concurrent.futures

  from sidecar._src.controller.connection import CALLS_IN_FLIGHT
  from tests.support import sidecar_fns
  server = make_server()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], connect_timeout=10,
                          timeout=30) as ctl, concurrent.futures.ThreadPoolExecutor(24) as pool:
    try:
      futures = [pool.submit(ctl.call, "wait_gate", args=("threads",)) for _ in range(24)]
      assert eventually(lambda: sidecar_fns.waiting("threads") == CALLS_IN_FLIGHT, timeout=10)
    finally:
      sidecar_fns.open_gate("threads")
    assert [f.result(timeout=30) for f in futures] == [[True]] * 24
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]  # every slot came back


def test_checkpoint_rpcs_that_never_end_starve_neither_calls_nor_other_sessions(make_server,
                                                                             tmp_path):
  import threading

  from sidecar._src.server.limits import CHECKPOINT_THREADS
  from tests.conftest import PEER_TOKEN
  server = make_server()
  raws = [Raw(server.port, replica_token=PEER_TOKEN) for _ in range(3)]  # peers: they may
  stop = threading.Event()

  def silent():  # a Receive stream that never sends its header
    stop.wait(30)
    yield b""

  def receive(raw):
    return raw.channel.stream_unary(f"/{protocol.CHECKPOINT_SERVICE}/Receive")(
        silent(), metadata=raw.metadata, timeout=30, wait_for_ready=True)

  pool = concurrent.futures.ThreadPoolExecutor(CHECKPOINT_THREADS + 2)
  try:
    calls = [pool.submit(receive, r) for r in raws for _ in range(CHECKPOINT_THREADS // 2 + 1)]
    refused = lambda: [c for c in calls if c.done()]
    assert eventually(lambda: len(refused()) == len(calls) - CHECKPOINT_THREADS, timeout=10)
    for c in refused():
      with pytest.raises(grpc.RpcError) as e:
        c.result()
      assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
      assert "checkpoint rpcs" in e.value.details()
    with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], connect_timeout=10,
                            timeout=10) as ctl:  # every checkpoint thread is taken
      assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
      assert ctl.status()[0].identity.host_id == 0
      # The controller's own checkpoint rpc is refused as busy, and asks again until a
      # thread is free (within its deadline), rather than fail.
      opened = ctl.checkpoint_client().open(0, str(tmp_path / "ck"), ram_steps=1,
                                             ram_budget=None, sweep=True)
      time.sleep(0.5)
      assert not opened.done()
      stop.set()
      assert opened.result(timeout=10) == []
  finally:
    stop.set()
    pool.shutdown(wait=True)
    for r in raws:
      r.close()
