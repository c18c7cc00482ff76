"""A step survives its trainers once saved (issue 62 item 3, issue 64 item 2): every trainer is
SIGKILLed at the racy moment, round after round, beside the same sidecars, and the next
round's trainers restore that step, each shard its own values.

- one host, one trainer, killed from a callback on ``handle.staged`` as it resolves (before
  ``save()`` returns): before, 7-8 of 8 steps were lost, the restart's open removed them
  as "a save that never committed";
- the same in a pool, as a tenant;
- two hosts (two processes under ``jax.distributed``, one per sidecar), and one sidecar
  serving two processes: every trainer killed right after ``save(k)`` returned everywhere.

The trainer is ``tests/support/kill_after_save.py``.
"""

import json
import os
import subprocess
import sys

import pytest

import sidecar
from sidecar._src.core import env as env_lib
from sidecar._src.tools import launch_env
from tests.support.paths import ROOT, entries

pytestmark = [pytest.mark.processes, pytest.mark.timeout(400)]


def run_job(cluster, directory, step: int, *, procs_per_host: int = 1, when: str = "returned",
            env: dict | None = None) -> list[dict]:
  """One round: the job's trainers restore the latest step and save ``step`` (-1: none),
  each SIGKILLed as ``when`` says; what each printed of its restore."""
  world = cluster.num_hosts * procs_per_host
  coordinator = f"127.0.0.1:{launch_env.free_port()}" if world > 1 else None
  base = {**os.environ, **(env or {})}
  trainers = [subprocess.Popen(
      [sys.executable, "-m", "tests.support.kill_after_save", str(directory), str(step), when],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=launch_env.trainer_env(cluster, host, coordinator, base, procs_per_host=procs_per_host,
                                 local_rank=rank))
      for host in range(cluster.num_hosts) for rank in range(procs_per_host)]
  outs = [t.communicate(timeout=180) for t in trainers]
  for t, (out, err) in zip(trainers, outs, strict=True):
    if step < 0:
      assert t.returncode == 0, out + err
    else:  # killed, or (the other gone first) failed after its save() returned
      assert t.returncode != 0, out + err
  return [json.loads(line) for out, _ in outs for line in out.splitlines()
          if line.startswith("{")]


def rounds(cluster, directory, steps: int, **kw) -> None:
  """``steps`` rounds, each killed after saving its step; every next round restores it."""
  world = cluster.num_hosts * kw.get("procs_per_host", 1)
  for k in range(1, steps + 2):
    restored = run_job(cluster, directory, k if k <= steps else -1, **kw)
    if k > 1:  # round k restores the step round k - 1 saved, and was killed after
      assert [(r["restored"], r["same"], r["data_state"]) for r in restored] == [
          (k - 1, True, {"position": (k - 1) * 10})] * world, restored
  assert restored[0]["steps"] == list(range(1, steps + 1))


@pytest.mark.parametrize("hosts, procs_per_host, steps", [(2, 1, 10), (1, 2, 3)],
                         ids=["two-hosts", "two-processes-one-sidecar"])
def test_a_step_saved_by_every_trainer_survives_them_all(tmp_path, hosts, procs_per_host, steps):
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(num_hosts=hosts, devices_per_host=1,
                                    shm_size="64MiB") as cluster:
    rounds(cluster, directory, steps, procs_per_host=procs_per_host)
  assert entries(directory) == [str(s) for s in sorted(range(1, steps + 1), key=str)]


def test_a_trainer_killed_as_its_save_is_staged_loses_no_step(tmp_path):
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1,
                                    shm_size="32MiB") as cluster:
    rounds(cluster, directory, 8, when="staged")


POOL = """\
tenants:
  - {name: alice, token_file: alice.token, arena: 0.5, checkpoint_roots: [alice]}
  - {name: bob, token_file: bob.token, arena: 0.25, checkpoint_roots: [bob]}
"""


def test_a_tenants_trainer_killed_as_its_save_is_staged_loses_no_step(tmp_path):
  for name in ("alice", "bob"):
    (tmp_path / f"{name}.token").write_text(f"token-of-{name}")
    os.chmod(tmp_path / f"{name}.token", 0o600)
    (tmp_path / name).mkdir()
  (tmp_path / "pool.yaml").write_text(POOL)
  os.chmod(tmp_path / "pool.yaml", 0o600)
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB",
                                    pool=str(tmp_path / "pool.yaml"),
                                    checkpoint_roots=[str(tmp_path)]) as cluster:
    rounds(cluster, tmp_path / "alice" / "ck", 3, when="staged",
           env={env_lib.TOKEN: "token-of-alice"})
