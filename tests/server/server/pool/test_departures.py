"""Tier 2: a pool's jobs over time (issue 37, item 4): a tenant's RAM-tier steps stay while
its job is there and for its ``ram_keep`` after it left, then go back to the arena; its
durable steps stay and restore bit-exact; another tenant's RAM-tier steps are untouched.
A client that vanishes loses its streams and feeds, its tenant's counts with them."""

import threading
import time

import numpy as np
import pytest

import sidecar
from sidecar._src.arena.worker import Worker
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire import codec, protocol
from sidecar._src.wire.protocol import pb
from tests.support import feed_fns, sidecar_fns  # noqa: F401  (they register)
from tests.support.pool_files import ALICE, BOB, controller, write_pool
from tests.support.raw_client import Raw

pytestmark = pytest.mark.server

POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice], ram_keep: 1s}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob]}
"""


def _ram_steps(server) -> dict[str, list[int]]:
  return {c.directory.rsplit("/", 2)[-2]: list(c.ram_steps)
          for c in server.checkpoints.tier.status() if c.ram_steps}


def test_a_departed_tenants_ram_steps_go_after_ram_keep(make_server, tmp_path):
  server = make_server(pool=write_pool(tmp_path, POOL))
  want = np.arange(1 << 16, dtype=np.float32)
  # Alice last, her worker at once: back well within her ram_keep however slow bob's save
  # (saved after hers, it could take past her 1 s on a loaded machine).
  for token, name in ((BOB, "bob"), (ALICE, "alice")):
    with controller(server, token) as ctl, ctl.checkpointer(str(tmp_path / name / "ck")) as ck:
      assert ck.save(1, {"w": want}).durable.result(30) == 1
  assert _ram_steps(server) == {"alice": [1], "bob": [1]}
  worker = Worker(server.options.socket_path, token=ALICE)  # alice's job is back meanwhile
  try:
    time.sleep(2.5)  # past her ram_keep: she is there, her steps stay
    assert _ram_steps(server) == {"alice": [1], "bob": [1]}
  finally:
    worker.close()
  deadline = time.monotonic() + 10
  while "alice" in _ram_steps(server):  # gone about ram_keep (1 s) after she left
    assert time.monotonic() < deadline, _ram_steps(server)
    time.sleep(0.05)
  assert _ram_steps(server) == {"bob": [1]}  # bob has no ram_keep: his stay
  with controller(server, ALICE) as ctl, ctl.checkpointer(str(tmp_path / "alice" / "ck")) as ck:
    assert ck.all_steps() == [1]
    got = ck.restore(1, target={"w": np.zeros_like(want)})
    np.testing.assert_array_equal(got["w"], want)  # from its durable copy


def _registry():
  reg = registry_lib.Registry()
  for entry in sidecar.default_registry():
    if entry.fn.__module__ in ("tests.support.feed_fns", "tests.support.sidecar_fns"):
      reg.add(entry.kind, entry.name, entry.fn)
  return reg


def test_a_vanished_clients_streams_and_feeds_are_its_tenants_to_lose(make_server, tmp_path):
  """Alice's client goes away mid-stream and mid-feed (its connection closes, no goodbye):
  her stream slots and feed counts come back; bob's stream runs on."""
  server = make_server(pool=write_pool(tmp_path), registry=_registry())
  alice, bob = Raw(server.port, token=ALICE), Raw(server.port, token=BOB)
  hold = threading.Event()

  def requests(start):
    yield pb.StreamRequest(start=start, prefetch=1)
    hold.wait(30)  # no credit more: the stream waits on its client

  def stream(raw, start):
    return raw._stream(requests(start), metadata=raw.metadata, timeout=30)

  count = pb.CallRequest(name="slow_count", args=codec.encode((1000, 0.01)),
                         kwargs=codec.encode({}))
  feed = pb.CallRequest(name="ids", args=codec.encode(()), kwargs=codec.encode({}),
                        feed=pb.FeedSpec(global_batch_size=2, rows=[pb.RowRange(start=0, stop=2)],
                                         shard_count=1))
  try:
    theirs = [stream(alice, count), stream(alice, feed)]
    for s in theirs:
      next(s)
    his = stream(bob, count)
    next(his)
    assert server.service._streams.by_tenant() == {"alice": 2, "bob": 1}
    assert server.tenancy.feed_counts()["alice"][0] == 1
    alice.close()  # gone: gRPC cancels her streams
    deadline = time.monotonic() + 10
    while server.service._streams.by_tenant().get("alice") or \
        server.tenancy.feed_counts().get("alice", (0, 0))[0]:
      assert time.monotonic() < deadline, server.service._streams.by_tenant()
      time.sleep(0.02)
    assert server.service._streams.by_tenant() == {"bob": 1}
  finally:
    hold.set()
    alice.close()
    bob.close()


def test_a_closed_controllers_sessions_go_back_at_once(make_server, tmp_path):
  """A Controller that closes ends its handshake sessions (Leave): its tenant's session
  quota has them back at once, not after session_idle_s; another tenant's token cannot
  end a session of alice's, and a session nobody knows is no error."""
  server = make_server(pool=write_pool(tmp_path, POOL))
  with controller(server, ALICE), controller(server, BOB) as b:
    assert server.sessions.count_of() == {"alice": 1, "bob": 1}
    alices = [s for s in list(server.sessions._last) if server.sessions.client(s) == "alice"]
    conn = next(iter(b._sidecars.conns.values()))
    leave = conn._channel.unary_unary(f"/{protocol.SERVICE}/Leave")
    for session in (*alices, "s-nobody"):  # bob's token, alice's session: it stays
      leave(pb.LeaveRequest().SerializeToString(), timeout=5,
            metadata=[(protocol.AUTH_KEY, f"Bearer {BOB}"), (protocol.SESSION_KEY, session)])
    assert server.sessions.count_of().get("alice") == len(alices)
  assert server.sessions.count_of() == {}
  assert server.sessions.expired == 0  # ended, not expired
