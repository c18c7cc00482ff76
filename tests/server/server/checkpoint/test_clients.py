"""Tier 2: one authenticated client against another's checkpoints (issue 23, items 3 and 4).

Each attacker holds the same token as its victim and speaks the Checkpoint service
through a client of its own; what it tries used to work.
"""

import json
import pathlib

import grpc
import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt import spec as spec_lib
from sidecar._src.ckptfmt.records import ShardId, ShardRecord
from sidecar._src.ckptfmt.save_values import Abort, Begin, Commit, Prepared, Stage
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import ckpt_pb, pb
from tests.support.staged import staged

pytestmark = pytest.mark.server

TOKEN = "s3cret"


def controller(server, **kw):
  return sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token=TOKEN, timeout=10, **kw)


def saved(server, directory, value: float) -> sidecar.jax.Controller:
  """A victim controller that saved step 1 of ``{"w": [value] * 1024}`` in ``directory``."""
  ctl = controller(server)
  with ctl.checkpointer(directory) as ckpt:
    assert ckpt.save(1, {"w": np.full(1024, value, np.float32)}).durable.result(30) == 1
  return ctl


def restored(ctl, directory) -> np.ndarray:
  with ctl.checkpointer(directory) as ckpt:
    return ckpt.restore(1, target={"w": np.zeros(1024, np.float32)})["w"]


def test_another_client_cannot_stage_into_or_commit_over_a_committed_step(make_server,
                                                                          tmp_path):
  server = make_server(token=TOKEN)
  directory = tmp_path / "ck"
  victim = saved(server, directory, 1.0)
  item = str(directory / "1" / "default")
  manifest = json.loads((directory / "1" / "default" / "sidecar_manifest.json").read_text())
  leaves = [spec_lib.spec_from_dict(d) for d in manifest["leaves"]]
  with controller(server, attach=False) as attacker:
    client = attacker.checkpoint_client()
    evil = staged(("w",), 0, ((0, 1024),), np.full(1024, 666.0, np.float32))
    with pytest.raises(sidecar.SidecarError) as info:  # the committed item as the tmp one
      client.send(0, Stage(directory=str(directory), step=1, tmp_dir=item, final_dir=item,
                            leaves=leaves, shards=[evil], last=True)).result()
    assert isinstance(info.value, PermissionError), info.value
    assert "is not inside an uncommitted step directory" in str(info.value)
    for whole_step in (False, True):
      with pytest.raises(sidecar.SidecarError) as info:
        client.send(0, Commit(tmp_dir=item, step=1, num_hosts=1, leaves=leaves, shards=[],
                                data_state_json="", whole_step=whole_step, replicas=None),
                      timeout=10).result()
      assert isinstance(info.value, PermissionError), info.value
    # A tmp step of its own beside it, committed over the victim's item: refused too.
    tmp_item = str(directory / "1.orbax-checkpoint-tmp" / "default")
    with pytest.raises(sidecar.SidecarError, match="is committed already"):
      client.send(0, Stage(directory=str(directory), step=1, tmp_dir=tmp_item,
                            final_dir=item, leaves=leaves, shards=[evil], last=True)).result()
  np.testing.assert_array_equal(restored(victim, directory), np.full(1024, 1.0, np.float32))
  victim.close()


def test_another_client_cannot_join_or_commit_a_save_in_flight(make_server, tmp_path):
  """The victim staged step 2's first part (its writer waits for the rest); the attacker's
  part of it, its begin of the step and its commit of the item are refused."""
  server = make_server(token=TOKEN)
  directory = tmp_path / "ck"
  victim = saved(server, directory, 1.0)
  tmp_item = str(directory / "2.orbax-checkpoint-tmp" / "default")
  final_dir = str(directory / "2" / "default")
  manifest = json.loads((directory / "1" / "default" / "sidecar_manifest.json").read_text())
  leaves = [spec_lib.spec_from_dict(d) for d in manifest["leaves"]]
  mine = victim.checkpoint_client()
  mine.send(0, Begin(str(directory), 2, "orbax")).result()
  half = staged(("w",), 0, ((0, 1024),), np.full(1024, 2.0, np.float32))
  mine.send(0, Stage(directory=str(directory), step=2, tmp_dir=tmp_item, final_dir=final_dir,
                      leaves=leaves, shards=[], last=False)).result()
  with controller(server, attach=False) as attacker:
    theirs = attacker.checkpoint_client()
    evil = staged(("w",), 0, ((0, 1024),), np.full(1024, 666.0, np.float32))
    with pytest.raises(sidecar.SidecarError, match="is being saved by another session"):
      theirs.send(0, Stage(directory=str(directory), step=2, tmp_dir=tmp_item, final_dir=final_dir,
                            leaves=leaves, shards=[evil], last=True)).result()
    with pytest.raises(sidecar.SidecarError, match="is being saved by another session"):
      # It would remove the victim's files.
      theirs.send(0, Begin(str(directory), 2, "orbax")).result()
    with pytest.raises(sidecar.SidecarError, match="a session commits only the save it began"):
      theirs.send(0, Commit(tmp_dir=tmp_item, step=2, num_hosts=1, leaves=leaves, shards=[],
                              data_state_json="", whole_step=True, replicas=None),
                    timeout=10).result()
  mine.send(0, Stage(directory=str(directory), step=2, tmp_dir=tmp_item, final_dir=final_dir,
                      leaves=[], shards=[half], last=True)).result()
  sums = mine.send(0, Prepared(final_dir, 30), timeout=30).result()
  mine.send(0, Commit(tmp_dir=tmp_item, step=2, num_hosts=1, leaves=leaves, shards=sums,
                        data_state_json="", whole_step=True, replicas=None), timeout=10).result()
  with victim.checkpointer(directory) as ckpt:
    got = ckpt.restore(2, target={"w": np.zeros(1024, np.float32)})["w"]
  np.testing.assert_array_equal(got, np.full(1024, 2.0, np.float32))
  victim.close()


def test_another_client_cannot_join_begin_or_commit_a_dcp_save_in_flight(make_server, tmp_path):
  """The same for a step in DCP's layout (``<path>.dcp-checkpoint-tmp``, committed over
  ``path`` as DCP overwrites): only the session that began staging it stages and commits."""
  from sidecar._src.ckptfmt import dcp
  server = make_server(token=TOKEN)
  path = tmp_path / "ck" / "step-3"
  part = dcp.DcpPart(0, 1)
  with controller(server) as victim, controller(server, attach=False) as attacker:
    mine, theirs = victim.checkpoint_client(), attacker.checkpoint_client()
    mine.open(0, str(path.parent), ram_steps=1, ram_budget=None, sweep=False).result()
    tmp = mine.send(0, Begin(str(path), 3, dcp.FORMAT)).result()
    assert tmp == str(dcp.tmp_path(path))
    mine.send(0, Stage(directory=str(path.parent), step=3, tmp_dir=tmp, final_dir=str(path),
                        leaves=[], shards=[], last=False, extra=part)).result()
    evil = staged(("w",), 0, ((0, 1024),), np.full(1024, 666.0, np.float32), rank=0)
    with pytest.raises(sidecar.SidecarError, match="is being saved by another session"):
      theirs.send(0, Stage(directory=str(path.parent), step=3, tmp_dir=tmp, final_dir=str(path),
                            leaves=[], shards=[evil], last=True, extra=part)).result()
    with pytest.raises(sidecar.SidecarError, match="is being saved by another session"):
      theirs.send(0, Begin(str(path), 3, dcp.FORMAT)).result()  # would remove its files
    with pytest.raises(sidecar.SidecarError, match="a session commits only the save it began"):
      theirs.send(0, Commit(tmp_dir=tmp, step=3, num_hosts=1, leaves=[], shards=[],
                              data_state_json="", whole_step=True, replicas=None),
                    timeout=10).result()
    with pytest.raises(sidecar.SidecarError, match="is not inside an uncommitted step"):
      theirs.send(0, Stage(directory=str(path.parent), step=3, tmp_dir=str(path),
                            final_dir=str(path), leaves=[], shards=[evil], last=True,
                            extra=part)).result()
    assert pathlib.Path(tmp).is_dir()  # the victim's save is still there
    mine.send(0, Abort(tmp, str(path)), timeout=10).result()


# ---- replicas: only from the job's other sidecars, checked, never silently dropped -----


def handshake(server, *, replica_token: str | None = None) -> tuple[grpc.Channel, list]:
  """A channel and the metadata of a fresh session on ``server`` (a peer's, with
  ``replica_token``)."""
  channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
  auth = [(protocol.AUTH_KEY, f"Bearer {TOKEN}")]
  if replica_token is not None:
    auth.append((protocol.REPLICA_KEY, f"Bearer {replica_token}"))
  reply = channel.unary_unary(
      f"/{protocol.SERVICE}/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString,
      response_deserializer=pb.HandshakeResponse.FromString)(
          pb.HandshakeRequest(versions=protocol.local_versions(), client="test"),
          metadata=auth, timeout=10)
  return channel, [*auth[:1], (protocol.SESSION_KEY, reply.session)]


def replica(directory, values: np.ndarray, *, crc32c: int | None = None, step: int = 1):
  """The messages of a replica of host 0's one shard of ``{"w": values}``, inline."""
  from sidecar._src.ckptfmt import records
  from sidecar._src.wire import checkpoint_wire as wire
  header = ckpt_pb.ReplicaHeader(directory=str(directory), step=step,
                                 final_dir=str(directory / str(step) / "default"), source=0)
  record = ShardRecord.of(ShardId(("w",), ((0, values.size),)), 0, values, host=0)
  part = ckpt_pb.ReplicaPart(
      record=wire.record_to_pb(record.with_crc32c(
          records.shard_crc32c(values) if crc32c is None else crc32c)),
      offset=0, data=values.tobytes())
  return [ckpt_pb.ReceiveRequest(header=header), ckpt_pb.ReceiveRequest(part=part),
          ckpt_pb.ReceiveRequest(done=True)]


def receive(channel, metadata, messages):
  return protocol.ckpt_pb_grpc.CheckpointStub(channel).Receive(iter(messages),
                                                               metadata=metadata, timeout=10)


def held_replicas(server, directory) -> dict:
  return dict(server.checkpoints.held(str(directory)).replicas)


def test_a_controller_cannot_plant_a_replica(make_server, tmp_path):
  """An attacker with the token plants host 0's replica of step 1 on host 1 before the
  owner's save: refused; the owner's real replica is the one held, and read back."""
  from tests.conftest import PEER_TOKEN
  servers = [make_server(token=TOKEN, host_id=h) for h in range(2)]
  directory = tmp_path / "ck"
  channel, metadata = handshake(servers[1])  # the token, not the peer token
  with pytest.raises(grpc.RpcError) as info:
    receive(channel, metadata, replica(directory, np.full(1024, 666.0, np.float32)))
  assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
  assert "accepted only from this job's other sidecars" in info.value.details()
  assert "--peer-token-file" in info.value.details()
  channel.close()
  for wrong in ("nope", PEER_TOKEN + "x"):  # a wrong peer token makes no peer either
    channel, metadata = handshake(servers[1], replica_token=wrong)
    with pytest.raises(grpc.RpcError, match="accepted only from this job's other sidecars"):
      receive(channel, metadata, replica(directory, np.full(1024, 666.0, np.float32)))
    channel.close()
  assert held_replicas(servers[1], directory) == {}
  state = {"w": np.full(1024, 1.0, np.float32)}
  with sidecar.jax.Controller([f"127.0.0.1:{s.port}" for s in servers], token=TOKEN,
                          timeout=10) as ctl, ctl.checkpointer(directory, replicas=1) as ckpt:
    handle = ckpt.save(1, state)
    assert handle.durable.result(30) == 1 and handle.replicated.result(30) == 1
    held = {h: held_replicas(s, directory) for h, s in enumerate(servers)}
    source, holder = (0, 1) if held[1] else (1, 0)  # whichever host staged the leaf
    assert list(held[holder][str(directory / "1" / "default")]) == [source]
    final_dir = str(directory / "1" / "default")
    (record,) = servers[holder].checkpoints.info(final_dir).shards
    got = servers[holder].checkpoints.read(final_dir, record, tier="replica")
    np.testing.assert_array_equal(got, state["w"])


def test_a_replica_is_checked_against_its_senders_crc32c_and_a_resend_replaces_it(
    make_server, tmp_path):
  from tests.conftest import PEER_TOKEN
  server = make_server(token=TOKEN, host_id=1)
  directory = tmp_path / "ck"
  channel, metadata = handshake(server, replica_token=PEER_TOKEN)
  first, second = np.full(1024, 1.0, np.float32), np.full(1024, 2.0, np.float32)
  with pytest.raises(grpc.RpcError) as info:  # bytes that are not what the sender summed
    receive(channel, metadata, replica(directory, second, crc32c=12345))
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
  assert "does not match the crc32c its sender computed (12345)" in info.value.details()
  assert held_replicas(server, directory) == {} and not server.checkpoints.tier.replicas()
  assert receive(channel, metadata, replica(directory, first)).nbytes == first.nbytes
  assert receive(channel, metadata, replica(directory, second)).nbytes == second.nbytes
  (record,) = server.checkpoints.tier.replicas()
  np.testing.assert_array_equal(record.shards[ShardId(("w",), ((0, 1024),))], second)  # the resend
  channel.close()


def test_a_tmp_directory_inside_a_committed_step_is_no_uncommitted_step(make_server, tmp_path):
  server = make_server(token=TOKEN)
  directory = tmp_path / "ck"
  victim = saved(server, directory, 1.0)
  manifest = json.loads((directory / "1" / "default" / "sidecar_manifest.json").read_text())
  leaves = [spec_lib.spec_from_dict(d) for d in manifest["leaves"]]
  evil = staged(("w",), 0, ((0, 1024),), np.full(1024, 666.0, np.float32))
  with controller(server, attach=False) as attacker:
    client = attacker.checkpoint_client()
    for inside in ("1/x.orbax-checkpoint-tmp/default", "1/default/x.orbax-checkpoint-tmp/w"):
      item = str(directory / inside)
      with pytest.raises(sidecar.SidecarError, match="outside any committed one"):
        client.send(0, Stage(directory=str(directory), step=7, tmp_dir=item,
                              final_dir=item.replace(".orbax-checkpoint-tmp", ""), leaves=leaves,
                              shards=[evil], last=True)).result()
  assert sorted(p.name for p in (directory / "1").iterdir()) == [
      "_CHECKPOINT_METADATA", "commit_success.txt", "default"]
  victim.close()


# ---- per-client tokens: each client sees and reads only the directories it opened -------


CLIENTS = (("alice", "alice-s3cret"), ("bob", "bob-s3cret"))


def test_with_per_client_tokens_a_client_sees_and_reads_only_its_own_checkpoints(
    make_server, tmp_path):
  server = make_server(client_tokens=CLIENTS)
  mine, theirs = tmp_path / "alice", tmp_path / "bob"
  state = {"w": np.full(1024, 1.0, np.float32)}
  alice = sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token="alice-s3cret", timeout=10)
  with alice.checkpointer(mine) as ckpt:
    assert ckpt.save(1, state).durable.result(30) == 1
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token="bob-s3cret", timeout=10,
                          attach=False) as bob:
    with bob.checkpointer(theirs) as ckpt:
      assert ckpt.save(1, {"w": np.zeros(4, np.float32)}).durable.result(30) == 1
    (status,) = bob.status()
    assert [c.directory for c in status.checkpoints] == [str(theirs)]  # not alice's
    client = bob.checkpoint_client()
    item = str(mine / "1" / "default")
    for attempt in (lambda: client.held(0, str(mine)), lambda: client.info(0, item),
                    lambda: client.delete(0, str(mine), 1),
                    lambda: client.forget(0, str(mine), 1)):
      with pytest.raises(sidecar.SidecarError, match="in no checkpoint directory client "
                         "'bob' opened") as info:
        attempt().result()
      assert isinstance(info.value, PermissionError)
    for other in (mine, tmp_path):  # alice's, or one that holds it
      with pytest.raises(PermissionError, match="another client opened"):
        bob.checkpointer(other)
  (status,) = alice.status()
  assert [c.directory for c in status.checkpoints] == [str(mine)]
  np.testing.assert_array_equal(restored(alice, mine), state["w"])
  alice.close()
  # A token not in the file, or the shared mode's absent token: nothing at all.
  with pytest.raises(sidecar.SidecarError):
    sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token="s3cret", connect_timeout=5)


def test_a_pool_tenant_is_told_about_its_pool_file_not_client_tokens(make_server, tmp_path):
  """Issue 42 item 8: a refusal names the mode the sidecar runs in."""
  from tests.support.pool_files import ALICE, BOB, controller, write_pool
  server = make_server(pool=write_pool(tmp_path))
  with controller(server, ALICE) as alice, alice.checkpointer(tmp_path / "alice" / "ck") as ckpt:
    assert ckpt.save(1, {"w": np.zeros(4, np.float32)}).durable.result(30) == 1
  with controller(server, BOB) as bob, bob.checkpointer(tmp_path / "bob" / "ck"):
    with pytest.raises(PermissionError, match=(
        rf"directory '{tmp_path}/alice/ck' is in no checkpoint directory client 'bob' opened "
        rf"on host 0; with the pool file {tmp_path}/pool.yaml \(--pool\) a client sees and "
        r"acts only in the directories it opened")) as info:
      bob.checkpoint_client().held(0, str(tmp_path / "alice" / "ck")).result()
    assert "--client-tokens" not in str(info.value)


def test_client_tokens_are_checked(tmp_path):
  from sidecar._src.core import env as env_lib, options as options_lib
  with pytest.raises(ValueError, match="exclude each other"):
    options_lib.ServerOptions(token="x", client_tokens=CLIENTS)
  with pytest.raises(ValueError, match="a name and a token of its own"):
    options_lib.ServerOptions(client_tokens=(("a", "t"), ("b", "t")))
  path = tmp_path / "clients"
  path.write_text("# name token\nalice alice-s3cret\n\nbob bob-s3cret  # the second\n")
  path.chmod(0o600)
  assert env_lib.client_tokens(str(path)) == CLIENTS
  path.write_text("alice\n")
  with pytest.raises(sidecar.InvalidArgumentError, match="clients:1: a line .* is 'NAME TOKEN'"):
    env_lib.client_tokens(str(path))
