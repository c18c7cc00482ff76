"""Tier 3: a pool sidecar process's per-tenant memfds (issue 42, item 1): a tenant's trainer
killed with SIGKILL, the tenant removed, and no memfd of it left in the sidecar."""

import os
import signal
import subprocess
import sys

import pytest

import sidecar
from tests.conftest import eventually

pytestmark = pytest.mark.processes

ALICE, BOB = "token-of-alice", "token-of-bob"
POOL = """\
tenants:
  - {name: alice, token_file: alice.token, arena: 4MiB, arena_ceiling: 8MiB}
  - {name: bob, token_file: bob.token, arena: 4MiB, arena_ceiling: 6MiB}
"""
ONLY_ALICE = "tenants: [{name: alice, token_file: alice.token, arena: 4MiB}]\n"
# A tenant's trainer: attaches, holds a block, says so, and waits to be killed.
TRAINER = """
import sys, time
import numpy as np
from sidecar._src.arena.worker import Worker
w = Worker(sys.argv[1], token=sys.argv[2])
a, _ = w.put(np.ones(1 << 16, np.uint8))
print(w.arena.size, flush=True)
time.sleep(120)
"""


def _memfds(pid: int) -> dict[str, int]:
  """The memfds process ``pid`` holds descriptors of, by name, and how many of each."""
  found: dict[str, int] = {}
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
      continue  # closed meanwhile
    if target.startswith("/memfd:"):
      name = target[len("/memfd:"):].removesuffix(" (deleted)")
      found[name] = found.get(name, 0) + 1
  return found


def test_a_killed_tenants_memfd_is_gone_from_the_sidecar_once_it_is_removed(tmp_path):
  for name, token in (("alice", ALICE), ("bob", BOB)):
    (tmp_path / f"{name}.token").write_text(token)
    os.chmod(tmp_path / f"{name}.token", 0o600)
  pool = tmp_path / "pool.yaml"
  pool.write_text(POOL)
  os.chmod(pool, 0o600)
  with sidecar.testing.LocalCluster(1, 1, shm_size="16MiB", pool=str(pool),
                                    configure_jax=False) as cluster:
    pid = cluster.pid(0)
    start = len(os.listdir(f"/proc/{pid}/fd"))
    for round_ in range(3):  # tenant churn: the descriptors must not grow
      trainers = [subprocess.Popen([sys.executable, "-c", TRAINER, cluster.socket(0), token],
                                   stdout=subprocess.PIPE, text=True)
                  for token in (ALICE, BOB)]
      try:
        sizes = [int(t.stdout.readline()) for t in trainers]
        assert sizes == [8 << 20, 6 << 20]  # each its own arena, of its ceiling
        held = _memfds(pid)
        assert held.get("sidecar-arena-alice") and held.get("sidecar-arena-bob"), held
        for t in trainers:
          os.kill(t.pid, signal.SIGKILL)
          t.wait(10)
      finally:
        for t in trainers:
          t.kill()
          t.wait()
      pool.write_text(ONLY_ALICE)
      cluster.reload()
      assert eventually(lambda: "sidecar-arena-bob" not in _memfds(pid), timeout=10), (
          f"round {round_}: {_memfds(pid)}")
      pool.write_text(POOL)
      cluster.reload()
    assert eventually(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= start + 4, timeout=10), (
        f"the sidecar's descriptors grew from {start} to {len(os.listdir(f'/proc/{pid}/fd'))}")
