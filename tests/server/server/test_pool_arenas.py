"""Tier 2: one arena per pool tenant (issue 42, item 1): attacks 8 and 11 of its fourth round.

A pool sidecar in this process with its real memfds; each tenant's Worker attaches over
the real worker socket and maps what it is handed, as a trainer would. Bob is the
attacker, alice the victim.
"""

import gc
import os
import socket

import grpc
import numpy as np
import pytest

import sidecar
from sidecar._src.arena.worker import Worker
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.wire import ipc
from sidecar._src.wire.protocol import pb
from tests.conftest import PEER_TOKEN, eventually
from tests.support.pool_files import ALICE, BOB, write_pool
from tests.support.raw_client import Raw, arena_ref, rejected

pytestmark = pytest.mark.server

POOL = """\
tenants:
  - {name: alice, token_file: alice.token, arena: 2MiB, arena_ceiling: 4MiB}
  - {name: bob, token_file: bob.token, arena: 2MiB, arena_ceiling: 3MiB}
"""
SECRET = np.frombuffer(b"alice's secret, 42 bytes of it, unguessed" * 1600, np.uint8)[:1 << 16]


@pytest.fixture
def pool_server(make_server, tmp_path):
  # The tests count this process's memfds by name: an earlier test's server that a
  # reference cycle still holds (found: test_replica_isolation's) keeps its tenants'
  # memfds until the collector runs, which is not this test's doing.
  gc.collect()
  return make_server(pool=write_pool(tmp_path, POOL))


def _memfds(name: str) -> int:
  """How many of this process's descriptors are memfds named ``name``."""
  count = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      count += os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{name} (deleted)"
    except OSError:
      pass  # closed meanwhile
  return count


def _finds(buffer: np.ndarray, needle: np.ndarray) -> bool:
  return bytes(needle[:64]) in bytes(buffer)


def test_a_tenants_worker_maps_its_own_arena_and_nothing_of_anothers(pool_server):
  """Attack 8: bob's Worker maps the memfd its attach hands it, looks for alice's block in
  it and writes all of it, then names her block by its offset and generation."""
  alice = Worker(pool_server.options.socket_path, token=ALICE)
  bob = Worker(pool_server.options.socket_path, token=BOB)
  raw = Raw(pool_server.port, token=BOB)
  try:
    array, ref = alice.put(SECRET)
    assert _finds(alice.arena.buffer, SECRET)
    assert not _finds(bob.arena.buffer, SECRET), "alice's block is in bob's mapping"
    bob.arena.buffer[:] = 0xFF  # all he can reach
    assert (array == SECRET).all()
    assert (alice.arena.size, bob.arena.size) == (4 << 20, 3 << 20)  # each its ceiling
    assert os.fstat(alice.arena.fd).st_ino != os.fstat(bob.arena.fd).st_ino
    e = rejected(lambda: raw.call("echo", arena_ref(ref.offset, ref.generation, ref.nbytes),
                                  worker_session=bob.session))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith(
        f"InvalidArgumentError: args[0]: the arena block at offset {ref.offset} generation "
        f"{ref.generation} is not one of the blocks of tenant 'bob'"), e.details()
    # Alice's own reference resolves in her arena, with no copy.
    mine = Raw(pool_server.port, token=ALICE)
    try:
      assert mine.call("size_of", arena_ref(ref.offset, ref.generation, ref.nbytes),
                       worker_session=alice.session).int_value == SECRET.nbytes
    finally:
      mine.close()
    del array
  finally:
    raw.close()
    bob.close()
    alice.close()


def test_a_revoked_tenant_keeps_its_mapping_and_sees_nothing_written_after(pool_server):
  """Attack 11: the operator removes bob and reloads; bob's process keeps the mapping its
  attach gave it, and reads it after alice writes."""
  alice = Worker(pool_server.options.socket_path, token=ALICE)
  bob = Worker(pool_server.options.socket_path, token=BOB)
  try:
    kept = bob.arena.buffer  # bob's process keeps this, whatever the sidecar does
    mine, _ = bob.put(np.ones(1 << 16, np.uint8))
    held = _memfds("sidecar-arena-bob")  # two each (an Arena's, its mmap's): sidecar's, bob's
    with open(pool_server.options.pool, "w") as f:
      f.write("tenants: [{name: alice, token_file: alice.token, arena: 2MiB, "
              "arena_ceiling: 4MiB}]\n")
    assert pool_server.reload().endswith("1 tenants; removed bob")
    assert eventually(bob.hung_up)
    array, _ = alice.put(SECRET)
    assert not _finds(kept, SECRET), "bob reads alice's array written after the reload"
    # The sidecar let go of bob's memfd once his blocks were back: his own fd is all left.
    assert held == 4 and eventually(lambda: _memfds("sidecar-arena-bob") == 2)
    assert pool_server.arenas.current("bob") is None
    with pytest.raises(sidecar.AuthenticationError):  # no new arena for him either
      Worker(pool_server.options.socket_path, token=BOB)
    del mine, array
  finally:
    bob.close()
    alice.close()


def test_tenant_churn_leaks_no_descriptor(pool_server, tmp_path):
  """Tenants attach, work, leave and are removed and added again: the sidecar keeps no
  memfd of a tenant that is gone, and its descriptors do not grow."""
  path = pool_server.options.pool
  only_alice = ("tenants: [{name: alice, token_file: alice.token, arena: 2MiB, "
                "arena_ceiling: 4MiB}]\n")

  def one_round():
    for token in (ALICE, BOB):
      with Worker(pool_server.options.socket_path, token=token) as w:
        a, _ = w.put(np.arange(1 << 16, dtype=np.uint8))
        del a
    with open(path, "w") as f:
      f.write(only_alice)
    pool_server.reload()
    with open(path, "w") as f:
      f.write(POOL)
    pool_server.reload()

  one_round()
  assert eventually(lambda: _memfds("sidecar-arena-bob") == 0)
  fds = len(os.listdir("/proc/self/fd"))
  for _ in range(5):
    one_round()
  assert eventually(lambda: _memfds("sidecar-arena-bob") == 0)
  # The sidecar's, kept for her next Worker (a closed Worker unmaps once its views died).
  assert eventually(lambda: _memfds("sidecar-arena-alice") == 2)
  assert len(os.listdir("/proc/self/fd")) <= fds + 2  # gRPC may hold a socket more or less
  assert pool_server.arenas.num_open() == 1


def test_a_tenants_feed_workers_write_its_batches_in_its_own_arena(make_server, tmp_path):
  """A feed's worker processes are handed its tenant's memfd, as its Worker is."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from sidecar._src.user import registry as registry_lib
  from tests.support import feed_fns

  reg = registry_lib.Registry()
  reg.add(registry_lib.PIPELINE, "ids", feed_fns.ids)
  server = make_server(pool=write_pool(tmp_path, POOL), registry=reg,
                       imports=("tests.support.feed_fns",))
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  kw = dict(global_batch_size=8, sharding=sharding, kwargs={"n": 32}, seed=3, num_epochs=1)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token=ALICE, timeout=30) as ctl:
    runs = []
    for workers in (0, 1):
      with ctl.feed("ids", options=sidecar.FeedOptions(workers=workers), **kw) as feed:
        batches = list(feed)
        buf = ctl.worker(0).arena.buffer
        for b in batches:
          pointer = b["x"].addressable_shards[0].data.unsafe_buffer_pointer()
          assert buf.ctypes.data <= pointer < buf.ctypes.data + buf.nbytes  # hers, no copy
        runs.append([np.asarray(b["id"]).tolist() for b in batches])
        del batches, b
    assert runs[0] == runs[1] and len(runs[0]) == 4
    assert ctl.worker(0).arena.size == 4 << 20


def test_a_peer_sidecars_link_attaches_to_the_arena_of_the_tenant_it_names(pool_server):
  """The same-machine replica path: another sidecar maps the arena of the tenant whose
  replica it sends, which only the peer token may name, and runs nothing as that tenant."""
  path = pool_server.options.socket_path
  link_token = tenants_lib.ReplicaAttach(PEER_TOKEN, "alice").token()
  with Worker(path, token=ALICE) as alice, Worker(path, token=link_token) as link:
    assert os.fstat(link.arena.fd).st_ino == os.fstat(alice.arena.fd).st_ino
    block, _ = link.put(SECRET)
    assert _finds(alice.arena.buffer, SECRET)
    del block
    with socket.socket(socket.AF_UNIX) as s:  # a call on the link's session: refused
      s.connect(path)
      ipc.send(s, {"op": "calls", "session": link.session})
      ipc.send_bytes(s, b"")
      answer = pb.CallResponse.FromString(ipc.recv_bytes(s))
    assert "is another sidecar's replica link" in answer.error.message
  with pytest.raises(sidecar.AuthenticationError, match="peer token is not this sidecar's"):
    Worker(path, token=tenants_lib.ReplicaAttach(BOB, "alice").token())
  with pytest.raises(sidecar.AuthenticationError, match="for tenant 'carol', which is not in"):
    Worker(path, token=tenants_lib.ReplicaAttach(PEER_TOKEN, "carol").token())