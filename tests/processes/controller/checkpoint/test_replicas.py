"""Peer replicas and restores from whatever survives: real sidecars, killed for real."""

import pathlib
import time

import jax
import numpy as np
import pytest

import sidecar
from sidecar._src.controller import status as status_lib
from sidecar._src.controller.checkpoint import shard_reads as checkpoint_restore
from sidecar._src.core import errors
from sidecar._src.server.checkpoint.faults import FAULT_ENV
from tests.conftest import arena_mappers, eventually, shm_entries
from tests.support.states import assert_same, state_on, target_on

pytestmark = pytest.mark.processes

FNS = ["tests.support.sidecar_fns"]


def chunk_files(directory: pathlib.Path, step: int) -> list[pathlib.Path]:
  item = directory / str(step) / "default"
  return [p for p in item.rglob("*") if p.is_file() and p.parent != item
          and not p.name.startswith(".") and p.parent.name != "array_metadatas"]


def held_replicas(ctl, directory):
  """{holder host: {source host: [steps]}} from every sidecar's status."""
  out = {}
  for s in ctl.status():
    for c in s.checkpoints:
      if c.directory == str(directory):
        for r in c.replicas:
          out.setdefault(s.identity.host_id, {})[r.source_host] = list(r.steps)
  return out


def test_three_hosts_lose_one_then_two(tmp_path):
  """Replicas=1 on 3 hosts: one host lost restores from RAM tiers and replicas with no
  storage read; two lost: storage where it is whole, else an error naming the shards."""
  before = shm_entries()
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(num_hosts=3, devices_per_host=1, shm_size="32MiB",
                                    imports=FNS) as cluster:
    devices = jax.devices()[:3]
    state = state_on(devices)
    with cluster.controller() as ctl, ctl.checkpointer(directory, replicas=1,
                                                       ram_steps=2) as ckpt:
      for step in (1, 2):
        handle = ckpt.save(step, state)
        assert handle.durable.result(60) == step
        assert handle.replicated.result(60) == step
      # host h's shards are held by host h+1, wrapping.
      assert held_replicas(ctl, directory) == {1: {0: [1, 2]}, 2: {1: [1, 2]}, 0: {2: [1, 2]}}
      table = status_lib.format_checkpoints([(a, s) for a, s in zip(cluster.addresses,
                                                                   ctl.status())])
      assert f"host 1  {directory}  RAM tier: [1, 2]  replicas: [1, 2] of host 0" in table
    for path in chunk_files(directory, 2):  # storage cannot give step 2 any more
      path.unlink()
    cluster.kill(0)
    # Reopened as the job opened it: a reopen keeps only its ram_steps (issue 45).
    with sidecar.jax.Controller(cluster.addresses[1:]) as ctl:
      with ctl.checkpointer(directory, ram_steps=2) as ckpt:
        restored = ckpt.restore(2, target=target_on(devices[1:], state))
        assert_same(restored, state)
        stats = ckpt.last_restore_stats()
        assert "storage" not in stats.shards
        # host 0's shard of w (and the leaves it staged alone) came from host 1's replica
        assert stats.shards["replica:host1"] == 3 and stats.shards["ram:host1"] == 1
        assert stats.shards["ram:host2"] == 1
        assert sum(stats.bytes.values()) == sum(np.asarray(x).nbytes
                                                for x in jax.tree.leaves(state))
    cluster.kill(1)
    with sidecar.jax.Controller(cluster.addresses[2:]) as ctl:
      with ctl.checkpointer(directory, ram_steps=2) as ckpt:
        restored = ckpt.restore(1, target=target_on(devices[2:], state))
        assert_same(restored, state)  # hosts 0 and 1's shards from storage
        # host 1's shards are still replicated on host 2; host 0's only in storage
        assert set(ckpt.last_restore_stats().shards) == {"ram:host2", "replica:host2",
                                                          "storage"}
        with pytest.raises(errors.ShardsLostError,
                           match=r"step 2 of .* cannot be restored: 3 shards have no live copy "
                                 r"and no valid stored copy: array 'b' shards \[\[\[0, 8\]\]\]; "
                                 r"array 'table' shards \[\[\[0, 10\]\]\]; array 'w' shards "
                                 r"\[\[\[0, 512\], \[0, 64\]\]\] \(staged by hosts \[0\], "
                                 r"replicated on hosts \[1\]\); "
                                 r"hosts gone: \[0, 1\]"):
          ckpt.restore(2, target=target_on(devices[2:], state))
  assert arena_mappers() == [] and shm_entries() == before


def test_two_hosts_replicate_and_a_peer_killed_mid_replication(tmp_path):
  """Two hosts mirror each other; host 1 killed while host 0's shards arrive: the step is
  durable, ``replicated`` fails naming the peer, host 0 unmaps host 1's arena."""
  before = shm_entries()
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="32MiB",
                                    imports=FNS,
                                    host_env={1: {FAULT_ENV: "replicate@2"}}) as cluster:
    devices = jax.devices()[:2]
    state = state_on(devices)
    with cluster.controller() as ctl, ctl.checkpointer(directory, replicas=1) as ckpt:
      first = ckpt.save(1, state)
      assert first.replicated.result(60) == 1 and first.durable.result(60) == 1
      # Listed once committed (a replica may be whole before its step's commit).
      assert held_replicas(ctl, directory) == {0: {1: [1]}, 1: {0: [1]}}
      handle = ckpt.save(2, state)
      assert handle.durable.result(60) == 2  # committed all the same
      with pytest.raises(errors.HostLostError,
                         match=r"host 0 could not replicate step 2 to hosts \[1\]"):
        handle.replicated.result(60)
      assert eventually(lambda: cluster.poll(1) is not None, 10)
      assert ckpt.all_steps() == [1, 2]
    maps = pathlib.Path(f"/proc/{cluster.pid(0)}/maps")  # host 0 maps only its own arena again
    assert eventually(lambda: maps.read_text().count("memfd:sidecar-arena") == 1, 10)
    with sidecar.jax.Controller(cluster.addresses[:1]) as ctl:
      with ctl.checkpointer(directory) as ckpt:
        assert_same(ckpt.restore(2, target=target_on(devices[:1], state)), state)
        assert "ram:host0" in ckpt.last_restore_stats().shards
  assert arena_mappers() == [] and shm_entries() == before


def test_link_to_a_peer_is_kept_between_steps_and_dropped_when_the_peer_dies(tmp_path):
  """Host 0 maps host 1's arena once for every step it replicates there; when host 1's
  sidecar is killed between saves, host 0 unmaps it without waiting for a next save."""
  before = shm_entries()
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="32MiB",
                                    imports=FNS) as cluster:
    devices = jax.devices()[:2]
    state = state_on(devices)
    maps = pathlib.Path(f"/proc/{cluster.pid(0)}/maps")
    with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck", replicas=1) as ckpt:
      for step in (1, 2, 3):
        handle = ckpt.save(step, state)
        assert handle.replicated.result(60) == step and handle.durable.result(60) == step
        assert maps.read_text().count("memfd:sidecar-arena") == 2  # its own and the peer's
      cluster.kill(1)
      assert eventually(lambda: maps.read_text().count("memfd:sidecar-arena") == 1, 10)
  assert arena_mappers() == [] and shm_entries() == before


def test_large_shards_of_unmapped_hosts_come_over_grpc_in_pieces(tmp_path, monkeypatch, caplog):
  """A controller that maps no arena reads RAM-tier shards inline, in pieces of at most
  READ_PIECE_BYTES (here 4 KiB: each 192 KiB half of "w" in 48 pieces), own copies and
  replicas alike; the storage copy is corrupt, so only the pieces can give the bytes."""
  monkeypatch.setattr(checkpoint_restore, "READ_PIECE_BYTES", 4096)
  pieced = []
  read_pieces = checkpoint_restore.ShardReads._read_pieces
  monkeypatch.setattr(checkpoint_restore.ShardReads, "_read_pieces",
                      lambda self, *a: pieced.append(a[3]) or read_pieces(self, *a))  # host
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="32MiB",
                                    imports=FNS) as cluster:
    devices = jax.devices()[:2]
    state = state_on(devices)
    with cluster.controller(attach=False) as ctl:
      with ctl.checkpointer(directory, replicas=1) as ckpt:
        handle = ckpt.save(1, state)
        assert handle.durable.result(60) == 1 and handle.replicated.result(60) == 1
      for path in chunk_files(directory, 1):
        path.write_bytes(b"\0" * path.stat().st_size)
      with ctl.checkpointer(directory) as ckpt:
        assert_same(ckpt.restore(1, target=target_on(devices, state)), state)
        assert sorted(ckpt.last_restore_stats().shards) == ["ram:host0", "ram:host1"]
      assert sorted(pieced) == [0, 1]  # one read in pieces per half of "w", from its own host
      cluster.kill(1)
    pieced.clear()
    with sidecar.jax.Controller(cluster.addresses[:1], attach=False) as ctl:
      with ctl.checkpointer(directory, replicas=1) as ckpt:  # 1 host left: no peer to use
        restored = ckpt.restore(1, target=target_on(devices[:1], state))
        assert_same(restored, state)
        assert "replica:host0" in ckpt.last_restore_stats().shards
        # As with replicas=0: the step at once, as for every framework (it held None).
        assert ckpt.save(2, restored).replicated.result(60) == 2
    assert sorted(pieced) == [0, 0]  # host 1's half from its replica on host 0, in pieces
    assert "replicas=1, but there are 1 hosts: each shard gets 0 replica copies" in caplog.text


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
def test_replica_bandwidth_paces_the_sending(tmp_path, shared_memory):
  """Each host's 192 KiB half of "w" (and "b", "table") at 256 KiB/s: the replica cannot be
  whole in less than 0.75 s from its start (the sleeps set that bound), and is whole and
  right."""
  env = {} if shared_memory else {h: {"SIDECAR_REPLICA_SHM": "0"} for h in range(2)}
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="32MiB",
                                    imports=FNS, host_env=env) as cluster:
    devices = jax.devices()[:2]
    state = state_on(devices)
    with cluster.controller() as ctl:
      with pytest.raises(sidecar.InvalidArgumentError, match=r"replica_bandwidth: .*'fast'"):
        ctl.checkpointer(tmp_path / "ck", replicas=1, replica_bandwidth="fast")
      with ctl.checkpointer(tmp_path / "ck", replicas=1, replica_bandwidth="256KiB") as ckpt:
        handle = ckpt.save(1, state)
        handle.staged.result(60)
        t0 = time.monotonic()
        assert handle.replicated.result(60) == 1
        assert time.monotonic() - t0 >= 0.5  # the sleeps alone take 0.75 s from its start
      assert held_replicas(ctl, tmp_path / "ck") == {0: {1: [1]}, 1: {0: [1]}}
      cluster.kill(1)
    with (sidecar.jax.Controller(cluster.addresses[:1]) as ctl,
          ctl.checkpointer(tmp_path / "ck") as ckpt):
      assert_same(ckpt.restore(1, target=target_on(devices[:1], state)), state)
      assert "replica:host0" in ckpt.last_restore_stats().shards


def test_corrupt_chunk_files_restore_from_memory_over_grpc(tmp_path):
  """A step whose stored chunks are corrupt restores from the RAM tier; the replica went
  inline over gRPC (no shared memory between the sidecars) and checks its crc32c."""
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="32MiB",
                                    imports=FNS,
                                    host_env={h: {"SIDECAR_REPLICA_SHM": "0"}
                                              for h in range(2)}) as cluster:
    devices = jax.devices()[:2]
    state = state_on(devices)
    with cluster.controller() as ctl, ctl.checkpointer(directory, replicas=1) as ckpt:
      assert ckpt.save(1, state).replicated.result(60) == 1
    assert "over gRPC" in cluster.log(0)
    for path in chunk_files(directory, 1):
      with open(path, "r+b") as f:  # flip a byte of every chunk
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    cluster.kill(1)
    with sidecar.jax.Controller(cluster.addresses[:1]) as ctl, ctl.checkpointer(directory) as ckpt:
      assert_same(ckpt.restore(1, target=target_on(devices[:1], state)), state)
      assert set(ckpt.last_restore_stats().shards) == {"ram:host0", "replica:host0"}


def test_a_pool_on_one_machine_replicates_over_shared_memory(tmp_path, monkeypatch):
  """Attack 13 (issue 42): ``sidecar local --pool FILE --hosts 2`` and replicas=1. Each
  sidecar's link to the other's worker socket proves the peer token and names the tenant:
  accepted (on main every replication failed, the link refused as a trainer without
  SIDECAR_TOKEN), and the replicas count against the tenant on the holding host."""
  from sidecar._src.core import env as env_lib
  from tests.support import pool_files
  pool = pool_files.write_pool(tmp_path, "tenants:\n  - {name: alice, token_file: "
                               "alice.token, checkpoint_roots: [alice]}\n")
  monkeypatch.setenv(env_lib.TOKEN, pool_files.ALICE)  # alice's trainer, and her Workers
  directory = tmp_path / "alice" / "ck"
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="32MiB",
                                    pool=pool) as cluster:
    state = state_on(jax.devices()[:2])
    with cluster.controller(token=pool_files.ALICE) as ctl, ctl.checkpointer(
        directory, replicas=1) as ckpt:
      handle = ckpt.save(1, state)
      assert handle.durable.result(60) == 1 and handle.replicated.result(60) == 1
      assert held_replicas(ctl, directory) == {0: {1: [1]}, 1: {0: [1]}}
      rows = [s.tenants for s in ctl.status()]
      assert all(r[0].name == "alice" and r[0].ram_tier_bytes > 0 for r in rows), rows
    logs = cluster.log(0) + cluster.log(1)
    assert "over shared memory" in logs and "SIDECAR_TOKEN" not in logs
