"""Two trainer processes under jax.distributed beside ONE sidecar (a node's ranks sharing
its sidecar, as ``sidecar slurm batch --hosts-per-node 1`` runs them): each process has its
own Worker session; feeds give each process the rows its devices own; a save stages both
processes' shards into the one host and commits once; a restore reads both back.

The trainer is tests/support/train.py, as in test_multiprocess.py; the results must be
those of one process that owns every device (tests/support/trainers.single).
"""

import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from sidecar._src.ckptfmt.orbax import read as orbax_read
from sidecar._src.tools import launch
from sidecar._src.tools.local import LocalCluster
from tests.support.paths import ROOT
from tests.support.trainers import by_process, results, single, without

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


def shared(directory, scenario: str) -> tuple[list[int], list[dict], str]:
  """Runs the trainer as 2 processes x 2 CPU devices beside one sidecar (host 0)."""
  with LocalCluster(1, 2, imports=["tests.support.feed_fns"], shm_size="64MiB",
                    configure_jax=False, assign_device_ids=False) as cluster:
    coordinator = f"127.0.0.1:{launch.free_port()}"
    procs = []
    for p in range(2):
      env = launch.trainer_env(cluster, 0, coordinator, os.environ)
      env.update(SIDECAR_NUM_PROCESSES="2", SIDECAR_PROCESS_ID=str(p), XLA_FLAGS="")
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "tests.support.train", "multi", str(directory), scenario],
          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
  output = "\n".join(f"--- process {i}:\n{o}" for i, o in enumerate(outputs))
  return [p.returncode for p in procs], [r for o in outputs for r in results(o)], output


def test_two_processes_share_one_sidecar_and_train_as_one_process(tmp_path):
  codes, multi, output = shared(tmp_path / "shared", "train")
  assert codes == [0, 0], output
  p0, p1 = by_process(multi, 0), by_process(multi, 1)
  assert without(p0, "identity") == without(p1, "identity")
  one = single(tmp_path / "single", "train")
  assert without(p0, "identity") == without(by_process(one, 0), "identity")
  ident = by_process(multi, 0)[0]
  assert ident["local_hosts"] == [0] and p1[0]["local_hosts"] == [0]
  assert set(ident["device_hosts"].values()) == {0} and len(ident["device_hosts"]) == 4
  restored = next(r for r in p0 if r["kind"] == "restored")
  assert restored["same"] and restored["step"] == 4
  assert sorted(orbax_read.list_steps(str(tmp_path / "shared"))) == [2, 4]
  # Stock Orbax restores what the two processes saved through their one sidecar.
  with ocp.CheckpointManager(tmp_path / "shared") as mngr:
    stock = mngr.restore(4, args=ocp.args.StandardRestore(
        {"w": np.zeros((8, 4), np.float32), "bias": np.zeros(4, np.float32), "step": 0}))
  assert np.asarray(stock["w"]).tolist() == next(r for r in p0 if r["kind"] == "saved")["w"]
  # A new job of two processes beside a new sidecar restores it from storage, bit-exact.
  codes, again, output = shared(tmp_path / "shared", "restore")
  assert codes == [0, 0], output
  for p in (0, 1):
    got = next(r for r in by_process(again, p) if r["kind"] == "restored")
    assert got["step"] == 4 and got["w"] == np.asarray(stock["w"]).tolist()
