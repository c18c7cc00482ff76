"""Tier 2: replicas go only to the job's own sidecars, and count against their tenant
(issue 42 item 4, attacks 3 and 12 of the fourth round).

A client names a replica target by host id only: the sidecar dials the address its own
``--replica-hosts`` gives, never one a client sent, so the peer token reaches no server of
the client's. The peer token is no tenant: it sees no tenant's rows and may only send
replicas. A replica carries its tenant, and the receiving host counts its blocks against
that tenant's arena ceiling, whether or not the tenant opened the directory there.
"""

import dataclasses
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

import sidecar
from sidecar._src.arena.worker import Worker
from sidecar._src.ckptfmt.records import (
  ReplicaHeader,
  ReplicaTarget,
  ShardId,
  ShardRecord,
  Staged,
)
from sidecar._src.core import env as env_lib, errors
from sidecar._src.server.checkpoint import links as links_lib
from sidecar._src.wire import protocol
from sidecar._src.wire.pbscan import encode_varint
from sidecar._src.wire.protocol import ckpt_pb, pb
from tests.conftest import PEER_TOKEN
from tests.support import pool_files
from tests.support.pool_files import ALICE, BOB
from tests.support.raw_client import Raw, rejected

pytestmark = pytest.mark.server

TOKEN = "job-token"
MiB = 1 << 20


class _Listener(grpc.GenericRpcHandler):
  """A plain gRPC server of the attacker's: records the metadata of every call it gets."""

  def __init__(self):
    self.seen: list[dict] = []
    self.lock = threading.Lock()

  def service(self, handler_call_details):
    with self.lock:
      self.seen.append(dict(handler_call_details.invocation_metadata))
    return None  # UNIMPLEMENTED


def _field(number: int, payload: bytes) -> bytes:
  return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


def _replicate_to_address(final_dir: str, host_id: int, address: str) -> bytes:
  """A Replicate request as main's clients wrote it: a peer named by its address (field 2,
  ``Peer{host_id, address}``), which the sidecar used to dial with the peer token."""
  peer = b"\x08" + encode_varint(host_id) + _field(2, address.encode())
  return _field(1, final_dir.encode()) + _field(2, peer)


def test_replicate_dials_only_the_sidecars_own_hosts(make_server, tmp_path):
  """Attack 3: ``Replicate`` with an address of the attacker's: the sidecar dials none, and
  the peer token reaches no server of his; a host id not configured is INVALID_ARGUMENT
  naming it and the configured hosts."""
  servers = [make_server(token=TOKEN, host_id=h) for h in range(2)]
  listener = _Listener()
  attacker = grpc.server(futures.ThreadPoolExecutor(2),
                         handlers=[listener])
  port = attacker.add_insecure_port("127.0.0.1:0")
  attacker.start()
  directory = tmp_path / "ck"
  final_dir = str(directory / "1" / "default")
  try:
    with sidecar.jax.Controller([s.address for s in servers], token=TOKEN, attach=False,
                            timeout=10) as ctl, ctl.checkpointer(directory, replicas=0,
                                                                 ram_steps=2) as ckpt:
      for step in (1, 2):
        assert ckpt.save(step, {"w": np.full(1024, 1.0, np.float32)}).durable.result(30)
    source = 0  # every host staged its part of the step (host 0's may hold no shard)
    raw = Raw(servers[source].port, token=TOKEN)
    replicate = raw.channel.unary_unary(f"/{protocol.CHECKPOINT_SERVICE}/Replicate",
                                        request_serializer=None,
                                        response_deserializer=ckpt_pb.CheckpointReplicateResponse.FromString)
    reply = replicate(_replicate_to_address(final_dir, 1 - source, f"127.0.0.1:{port}"),
                      metadata=raw.metadata, timeout=30)
    assert list(reply.peers) == []  # no host id: nobody to send to
    attacker.stop(grace=None).wait()  # whatever was in flight has arrived
    assert listener.seen == []  # never dialled: the peer token went nowhere
    for host, why in ((7, "is not one of them"), (source, "is this sidecar itself")):
      error = rejected(lambda h=host: raw.ckpt.Replicate(ckpt_pb.CheckpointReplicateRequest(
          final_dir=final_dir, hosts=[h]), metadata=raw.metadata, timeout=30))
      assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
      assert f"replica target host {host} {why}" in error.details()
      assert (f"host 0 {servers[0].address}, host 1 {servers[1].address}"
              in error.details())  # the configured hosts
    reply = raw.ckpt.Replicate(ckpt_pb.CheckpointReplicateRequest(  # a host id: replicated
        final_dir=str(directory / "2" / "default"), hosts=[1 - source]),
        metadata=raw.metadata, timeout=30)
    assert list(reply.peers) == [1 - source]
    held = servers[1 - source].checkpoints.tier.replicas()
    assert [r.source for r in held] == [source]
    raw.close()
  finally:
    attacker.stop(grace=None)


def test_the_peer_token_is_no_tenant(make_server, tmp_path):
  """Attack 3's other half: whoever holds the pool's peer token sees no tenant's rows, runs
  nothing and checkpoints nothing: it only sends replicas."""
  server = make_server(pool=pool_files.write_pool(tmp_path))
  raw = Raw(server.port, token=PEER_TOKEN)
  status = raw.channel.unary_unary(f"/{protocol.SERVICE}/Status",
                                   request_serializer=pb.StatusRequest.SerializeToString,
                                   response_deserializer=pb.StatusResponse.FromString)
  assert list(status(pb.StatusRequest(), metadata=raw.metadata, timeout=10).tenants) == []
  error = rejected(lambda: raw.call("add", pb.Value(int_value=1), b=2))
  assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
  assert "the peer token is the sidecars' own" in error.details()
  error = rejected(lambda: raw.ckpt.Open(ckpt_pb.CheckpointOpenRequest(
      directory=str(tmp_path / "bob" / "ck")), metadata=raw.metadata, timeout=10))
  assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
  raw.close()
  with pool_files.controller(server, BOB) as ctl:  # a tenant still sees its own row
    (row,) = ctl.status()[0].tenants
    assert row.name == "bob"


POOL = """\
tenants:
  - name: alice
    token_file: alice.token
    arena: 0.4
    checkpoint_roots: [alice]
  - name: bob
    token_file: bob.token
    arena_ceiling: 16MiB
    checkpoint_roots: [bob]
"""


def test_a_replica_counts_against_its_tenant_on_the_receiving_host(make_server, tmp_path,
                                                                     monkeypatch):
  """Attack 12: bob (arena_ceiling 16 MiB) stages 6 MiB steps on host 0 and replicates each
  to host 1 over gRPC without opening the directory there: host 1 counts them against his
  ceiling (his row shows them) and refuses the third; alice's guaranteed 24 MiB then fits.
  (On main host 1 held all of them for nobody, and refused alice.)"""
  monkeypatch.setenv(env_lib.REPLICA_SHM, "0")  # over gRPC, as between machines
  monkeypatch.setattr(links_lib, "ARENA_WAIT_S", 0.5)  # a refusal comes at once
  path = pool_files.write_pool(tmp_path, POOL)
  servers = [make_server(pool=path, host_id=h, shm_size=64 * MiB) for h in range(2)]
  directory = tmp_path / "bob" / "ck"
  raw = Raw(servers[0].port, token=BOB)
  outcomes = []
  with pool_files.controller(servers[0], BOB) as ctl, ctl.checkpointer(directory) as ckpt:
    for step in (1, 2, 3):
      assert ckpt.save(step, {"w": np.full(3 * MiB // 2, step, np.float32)}).durable.result(30)
      try:
        raw.ckpt.Replicate(ckpt_pb.CheckpointReplicateRequest(
            final_dir=str(directory / str(step) / "default"), hosts=[1]),
            metadata=raw.metadata, timeout=60)
        outcomes.append("held")
      except grpc.RpcError as e:
        outcomes.append(e.details())
  raw.close()
  assert outcomes[:2] == ["held", "held"], outcomes
  assert "tenant 'bob' holds 12.0 MiB of the arena; 6.0 MiB more" in outcomes[2], outcomes
  assert "arena_ceiling=16.0 MiB" in outcomes[2], outcomes
  rows = {t.name: t for t in servers[1].service.tenant_status()}
  assert rows["bob"].arena_bytes == 12 * MiB  # his two replicas, on his row
  alice = Worker(servers[1].options.socket_path, token=ALICE)
  try:
    block, _ = alice.empty((24 * MiB,), np.uint8, timeout=5)  # within her guaranteed 25.6 MiB
    assert block.nbytes == 24 * MiB
    del block
  finally:
    alice.close()


def test_a_refused_link_says_it_is_the_sidecars_own(make_server, tmp_path):
  """Issue 42 item 8, for replicas: host 1's worker socket refuses host 0's replica link
  (its pool file has no tenant bob); the error says it is the sidecars' link, not a
  trainer's environment."""
  other = tmp_path / "other"
  other.mkdir()
  only_alice = "tenants:\n  - {name: alice, token_file: alice.token, checkpoint_roots: [alice]}\n"
  servers = [make_server(pool=pool_files.write_pool(tmp_path), host_id=0),
             make_server(pool=pool_files.write_pool(other, only_alice), host_id=1)]
  directory = tmp_path / "bob" / "ck"
  raw = Raw(servers[0].port, token=BOB)
  with pool_files.controller(servers[0], BOB) as ctl, ctl.checkpointer(directory) as ckpt:
    assert ckpt.save(1, {"w": np.ones(1024, np.float32)}).durable.result(30) == 1
    error = rejected(lambda: raw.ckpt.Replicate(ckpt_pb.CheckpointReplicateRequest(
        final_dir=str(directory / "1" / "default"), hosts=[1]), metadata=raw.metadata,
        timeout=30))
  raw.close()
  assert "the sidecars' own replica link (host 1's worker socket" in error.details()
  assert "tenant 'bob', which is not in this sidecar's pool" in error.details()
  assert "SIDECAR_TOKEN" not in error.details()
  assert not servers[1].checkpoints.tier.replicas()


def test_a_replica_is_received_only_for_the_tenant_its_link_attached_for(make_server, tmp_path):
  """Issue 42's gap (c): ``Receive`` took the header's tenant on trust while its blocks came
  over a worker session the sender attached (``ReplicaAttach``) for another tenant: a replica
  of bob's blocks was kept as alice's. Now it is PERMISSION_DENIED naming both, and nothing
  is kept; the same link sending for its own tenant is received."""
  server = make_server(pool=pool_files.write_pool(tmp_path), shm_size=64 * MiB)
  peer = ReplicaTarget(host_id=server.options.host_id, address=f"127.0.0.1:{server.port}")
  data = np.arange(1024, dtype=np.float32)
  shard = Staged(ShardRecord.of(ShardId(("w",), ((0, 1024),)), 0, data, host=7), data)
  header = ReplicaHeader(directory=str(tmp_path / "alice" / "ck"), step=1,
                         final_dir=str(tmp_path / "alice" / "ck" / "1" / "default"), source=7)
  with links_lib.ReplicaLink(peer, token=PEER_TOKEN, replica_token=PEER_TOKEN, tenant="bob",
                             timeout=10) as link:
    assert link.same_machine  # the blocks go through bob's arena there
    link.tenant = "alice"  # the header names another tenant than the attach did
    with pytest.raises(errors.PermissionDeniedError, match=(
        r"the replica's header is for tenant 'alice', but its blocks come over a worker "
        r"session the sending sidecar attached for tenant 'bob'")):
      link.send(header, [shard], timeout=10)
    assert not server.checkpoints.tier.replicas()
    link.tenant = "bob"
    bobs = dataclasses.replace(header, directory=str(tmp_path / "bob" / "ck"),
                               final_dir=str(tmp_path / "bob" / "ck" / "1" / "default"))
    assert link.send(bobs, [shard], timeout=10) == data.nbytes
  assert [r.source for r in server.checkpoints.tier.replicas()] == [7]


def test_only_the_job_s_sidecars_take_part_in_the_agreement_on_a_step(make_server, tmp_path):
  """The sidecars' agreement on a step (Agree) decides what is committed: a tenant's
  session, whatever it names, is refused (it could vouch for another's part); a peer
  sidecar's is answered (here: no such save)."""
  server = make_server(pool=pool_files.write_pool(tmp_path))
  state = ckpt_pb.AgreeState(final_dir=str(tmp_path / "bob" / "ck" / "1" / "default"),
                             save="s", step=1, host=1, phase=ckpt_pb.AGREE_WRITTEN)
  tenant = Raw(server.port, token=BOB)
  error = rejected(lambda: tenant.ckpt.Agree(state, metadata=tenant.metadata, timeout=10))
  assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
  assert "accepted only from this job's other sidecars" in error.details()
  tenant.close()
  peer = Raw(server.port, token=PEER_TOKEN, replica_token=PEER_TOKEN)
  answer = peer.ckpt.Agree(state, metadata=peer.metadata, timeout=10)
  assert (answer.phase, answer.host) == (ckpt_pb.AGREE_UNKNOWN, 0)
  peer.close()
