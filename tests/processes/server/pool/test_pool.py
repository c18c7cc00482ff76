"""Tier 3: one local pool (``LocalCluster(pool=...)``) of three tenants, one of them
misbehaving in turn (a handshake flood, filling its arena ceiling, reading another
tenant's step by path) while the other two keep feeding bit-exact and saving and
restoring bit-exact; then the misbehaving one is removed from the pool file (SIGHUP) and
its next call says so (issue 37).
"""

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.arena.worker import Worker
from sidecar._src.controller import status as status_lib
from sidecar._src.core import env as env_lib
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb
from tests.conftest import eventually
from tests.support.pool_files import ALICE, write_pool

pytestmark = pytest.mark.processes

TOKENS = {"alice": "token-of-alice", "bob": "token-of-bob", "carol": "token-of-carol"}
POOL = """\
tenants:
  - {name: alice, token_file: alice.token, arena: 0.25, checkpoint_roots: [alice]}
  - {name: bob, token_file: bob.token, arena: 0.25, checkpoint_roots: [bob]}
  - {name: carol, token_file: carol.token, arena: 0.1, arena_ceiling: 16MiB, sessions: 8,
     inline_bytes: 160MiB, checkpoint_roots: [carol]}
"""


def _write(tmp_path, text: str) -> str:
  for name, token in TOKENS.items():
    (tmp_path / f"{name}.token").write_text(token)
    os.chmod(tmp_path / f"{name}.token", 0o600)
    (tmp_path / name).mkdir(exist_ok=True)
  path = tmp_path / "pool.yaml"
  path.write_text(text)
  os.chmod(path, 0o600)
  return str(path)


# A tenant's trainer that stages a save of step 99 (which the sidecar writes only 2 s later:
# SIDECAR_CKPT_FAULT=slow@99) and then waits to be killed, before the step is durable.
KILLED_MID_SAVE = """
import sys, time
import numpy as np
import sidecar
ctl = sidecar.jax.Controller(sys.argv[2:], timeout=30)
ckpt = ctl.checkpointer(sys.argv[1])
ckpt.save(99, {"w": np.ones(2 << 20, np.float32)}).staged.result(30)
print("staged", flush=True)
time.sleep(120)
"""


def _arena_bytes(cluster, name) -> int:
  """The arena bytes tenant ``name`` holds, as its own Status says."""
  (row,) = status_lib.fetch(cluster.addresses[0], timeout=10, token=TOKENS[name]).tenants
  return row.arena_bytes


def _controller(cluster, monkeypatch, name):
  """A tenant's Controller, attached: its Worker presents the tenant's token."""
  monkeypatch.setenv(env_lib.TOKEN, TOKENS[name])
  ctl = cluster.controller(timeout=20)
  monkeypatch.delenv(env_lib.TOKEN)
  return ctl


def _batches(ctl, n=4):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with ctl.feed("ids", global_batch_size=4, sharding=sharding) as feed:
    return [np.asarray(next(feed)["x"]).copy() for _ in range(n)]


def _save_restore(ctl, directory, step):
  state = {"w": np.arange(1 << 16, dtype=np.float32) * step}
  with ctl.checkpointer(str(directory)) as ckpt:
    assert ckpt.save(step, state).durable.result(60) == step
    back = ckpt.restore(step, target={"w": np.zeros(1 << 16, np.float32)})
  assert np.asarray(back["w"]).tobytes() == state["w"].tobytes()


def _well_behaved(alice, bob, reference, tmp_path, step):
  assert all(np.array_equal(a, b) for a, b in zip(_batches(alice), reference, strict=True))
  _save_restore(bob, tmp_path / "bob" / "ck", step)
  _save_restore(alice, tmp_path / "alice" / "ck", step)


def test_a_pool_of_three_with_one_misbehaving(tmp_path, monkeypatch):
  monkeypatch.delenv(env_lib.TOKEN, raising=False)
  monkeypatch.delenv(env_lib.TOKEN_FILE, raising=False)
  path = _write(tmp_path, POOL)
  fault = {env_lib.CKPT_FAULT: "slow@99"}
  with sidecar.testing.LocalCluster(1, 1, shm_size="64MiB", pool=path, configure_jax=False,
                                    imports=["tests.support.feed_fns", "tests.support.sidecar_fns"],
                                    checkpoint_roots=[str(tmp_path)],
                                    host_env={0: fault}) as cluster:
    alice = _controller(cluster, monkeypatch, "alice")
    bob = _controller(cluster, monkeypatch, "bob")
    carol = _controller(cluster, monkeypatch, "carol")
    # Not attached: its calls' arrays travel inline, not through the arena.
    inline = sidecar.jax.Controller(cluster.addresses, token=TOKENS["carol"], attach=False,
                                timeout=20)
    reference = _batches(alice)
    _well_behaved(alice, bob, reference, tmp_path, 1)

    # 0. Carol's trainer is killed mid-save (staged, being written): her sidecar commits
    # the step all the same (one host alone holds it), in her root; nobody else's step is
    # touched; its RAM-tier copy is in her share until she drops it.
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path / "carol" / "ck"),
         *cluster.addresses], stdout=subprocess.PIPE, text=True,
        env={**os.environ, env_lib.TOKEN: TOKENS["carol"]})
    try:
      assert child.stdout.readline().strip() == "staged", "carol's trainer did not stage"
      assert _arena_bytes(cluster, "carol") >= 8 << 20
    finally:
      child.kill()
      child.wait()
    _well_behaved(alice, bob, reference, tmp_path, 2)
    with carol.checkpointer(str(tmp_path / "carol" / "ck")) as ckpt:  # waits for the commit
      assert ckpt.all_steps() == [99]
      assert _arena_bytes(cluster, "carol") >= 8 << 20  # its RAM-tier copy: hers
      ckpt.drop_ram_tier()
    assert eventually(lambda: _arena_bytes(cluster, "carol") == 0, timeout=20), \
        "carol's dropped RAM-tier copy still holds the arena"

    # 1. Carol floods handshakes: refused as hers, and a new client joins at once. (Bob's
    # process started first: a tenant's first call pays its process's start, seconds here.)
    assert bob.call("add", args=(0,), kwargs={"b": 0}) == [0]
    channel = grpc.insecure_channel(cluster.addresses[0])
    handshake = channel.unary_unary(f"/{protocol.SERVICE}/Handshake",
                                    request_serializer=pb.HandshakeRequest.SerializeToString)
    refused = []
    for _ in range(40):
      try:
        handshake(pb.HandshakeRequest(versions=protocol.local_versions()), timeout=10,
                  metadata=[(protocol.AUTH_KEY, f"Bearer {TOKENS['carol']}")])
      except grpc.RpcError as e:
        refused.append(e.details())
    channel.close()
    assert len(refused) == 40 - (8 - 3)  # three are carol's Controllers' (one killed)
    assert refused[-1].startswith("ResourceExhaustedError: tenant 'carol' keeps 8 handshake "
                                  "sessions, its quota (sessions=8, "), refused[-1]
    t0 = time.monotonic()
    late = _controller(cluster, monkeypatch, "bob")
    assert late.call("add", args=(1,), kwargs={"b": 2}) == [3]
    assert time.monotonic() - t0 < 1.0 + 2.0  # joined at once (an attach included)
    late.close()
    _well_behaved(alice, bob, reference, tmp_path, 3)

    # 2. Carol fills her arena ceiling: her own refusal, the others unharmed.
    hog = Worker(cluster.socket(0), token=TOKENS["carol"])
    held = []
    with pytest.raises(sidecar.ResourceExhaustedError,
                       match=r"tenant 'carol' holds .* more would pass its quota "
                       r"\(arena_ceiling=16.0 MiB"):
      for _ in range(64):
        held.append(hog.empty((1 << 20,), np.uint8, timeout=0))  # else: it queues
    assert len(held) >= 14
    _well_behaved(alice, bob, reference, tmp_path, 4)
    del held
    hog.close()

    # 3. Carol reads alice's step by its path: refused.
    with pytest.raises(PermissionError):
      with carol.checkpointer(str(tmp_path / "alice" / "ck")) as ckpt:
        ckpt.restore(1, target={"w": np.zeros(1 << 16, np.float32)})

    # 3b. Carol's 128 MiB inline calls (not through the arena) in a loop, while the others
    # feed and save: within her inline_bytes they run; one past it is refused.
    sizes: list = []

    def inline_loop():
      big = np.ones(128 << 20, np.uint8)
      for _ in range(3):
        sizes.append(inline.call("size_of", args=(big,)))
    looping = threading.Thread(target=inline_loop, name="test-inline-loop")
    looping.start()
    try:
      _well_behaved(alice, bob, reference, tmp_path, 5)
    finally:
      looping.join(120)
    assert sizes == [[128 << 20]] * 3
    bigger = np.ones(176 << 20, np.uint8)
    with pytest.raises(sidecar.ResourceExhaustedError,
                       match=r"tenant 'carol' sent an inline request of \d+ bytes, more "
                       r"than its quota \(inline_bytes=167772160"):
      inline.call("size_of", args=(bigger,))
    del bigger
    inline.close()

    # 4. Carol is removed from the pool file: her next call says so within a second.
    (tmp_path / "pool.yaml").write_text("\n".join(POOL.splitlines()[:3]) + "\n")
    cluster.reload()
    deadline = time.monotonic() + 1.0
    while True:
      try:
        carol.call("add", args=(1,))
      except sidecar.AuthenticationError as e:
        assert f"tenant 'carol' was removed from the pool file {path}" in str(e)
        break
      assert time.monotonic() < deadline, "carol still served a second after the reload"
      time.sleep(0.05)
    _well_behaved(alice, bob, reference, tmp_path, 6)
    for ctl in (alice, bob):
      ctl.close()
    carol.close()

    # 5. The pool's sidecar is killed and started again: a tenant reconnects, and finds its
    # durable steps (and only its own directories may be opened, as before).
    cluster.kill(0)
    cluster.restart(0)
    alice = _controller(cluster, monkeypatch, "alice")
    with alice.checkpointer(str(tmp_path / "alice" / "ck")) as ckpt:
      assert ckpt.all_steps() == [1, 2, 3, 4, 5, 6]
      back = ckpt.restore(6, target={"w": np.zeros(1 << 16, np.float32)})
    assert np.asarray(back["w"]).tobytes() == (np.arange(1 << 16, dtype=np.float32) * 6
                                                ).tobytes()
    assert all(np.array_equal(a, b) for a, b in zip(_batches(alice), reference, strict=True))
    alice.close()


def test_serve_refuses_a_bad_pool_file_naming_its_line(tmp_path):
  path = _write(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, quota: 1}\n")
  done = subprocess.run(
      [sys.executable, "-m", "sidecar", "serve", "--pool", path, "--listen", "127.0.0.1",
       "--port", "0", "--health-port", "0", "--socket", str(tmp_path / "s.sock"),
       "--shm-size", "8MiB"], capture_output=True, text=True, timeout=120,
      env={k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")})
  assert done.returncode == 2
  assert f"sidecar serve: {path}:2: unknown key 'quota' in a tenant (line 2)" in done.stderr


CONNECTIONS_POOL = """\
tenants:
  - {name: alice, token_file: alice.token, connections: 3}
  - {name: bob, token_file: bob.token}
"""

_HOLDING_WORKER = """\
import sys
from sidecar._src.arena.worker import Worker
worker = Worker(sys.argv[1], token=sys.argv[2])
print(worker.session, flush=True)
sys.stdin.read()
"""


def test_a_tenant_s_worker_sessions_are_its_connections_given_back_as_each_ends(
    make_server, tmp_path):
  """Issue 70: worker sessions need no quota of their own: each is one worker-socket
  connection while it lives, counted against its tenant's ``connections`` (here 3), refused
  past it naming the tenant, the limit, its pool.yaml line and the fix, and given back when
  its socket closes, a worker killed with SIGKILL included."""
  pool_server = make_server(pool=write_pool(tmp_path, CONNECTIONS_POOL))
  socket_path = pool_server.options.socket_path
  child = subprocess.Popen([sys.executable, "-c", _HOLDING_WORKER, socket_path, ALICE],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  alice = []
  try:
    assert child.stdout.readline().startswith("w-")  # attached: one of alice's 3
    alice = [Worker(socket_path, token=ALICE) for _ in range(2)]
    refusal = (r"tenant 'alice' holds 3 connections to the worker socket, its quota "
               rf"\(connections=3, {pool_server.options.pool}:2\); close Workers and streams "
               r"that are done, or ask the pool's operator to raise its connections in the "
               r"pool file")
    with pytest.raises(sidecar.ResourceExhaustedError, match=refusal):
      Worker(socket_path, token=ALICE)
    assert pool_server.workers.num_sessions() == 3
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert eventually(lambda: pool_server.workers.num_sessions() == 2, timeout=30)
    alice.append(Worker(socket_path, token=ALICE))  # the killed worker's count came back
    with pytest.raises(sidecar.ResourceExhaustedError, match=refusal):
      Worker(socket_path, token=ALICE)
    alice.pop().close()
    assert eventually(lambda: pool_server.workers.num_sessions() == 2, timeout=30)
    alice.append(Worker(socket_path, token=ALICE))  # and a closed one's
  finally:
    if child.poll() is None:
      child.kill()
      child.wait(30)
    for w in alice:
      w.close()
