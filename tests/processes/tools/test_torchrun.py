"""sidecar torchrun: stock torchrun, a node per pod of the manifests (here, two processes
with the environment two pods get), the ranks of both nodes one job."""

import json
import os
import subprocess
import sys

import pytest

from sidecar._src.core import platform
from sidecar._src.tools.launch_env import free_port
from tests.support.jobset_env import JOBSET_ENV

pytestmark = pytest.mark.processes

RANK = """import json, os
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
got = {n: os.environ[n] for n in names}
got["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS")
os.write(1, ("RANK " + json.dumps(got) + "\\n").encode())  # one write: ranks share the pipe
"""
# Pod 0's node shows no accelerator (as this machine), pod 1's a TPU by its variables.
NO_PLATFORM = {k: v for k, v in os.environ.items()
               if k not in ("JAX_PLATFORMS", "XLA_FLAGS") and not k.startswith("TPU_")}
POD_ENV = [{}, {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}]


def test_two_pods_of_two_ranks_are_one_job_of_four(tmp_path):
  script = tmp_path / "rank.py"
  script.write_text(RANK)
  port = free_port()
  pods = []
  for host in range(2):  # one slice of two pods; process 0's pod is the master
    env = {**NO_PLATFORM, **POD_ENV[host], **JOBSET_ENV, "SIDECAR_NUM_SLICES": "1",
           "SIDECAR_HOSTS_PER_SLICE": "2", "SIDECAR_SLICE_ID": "0",
           "SIDECAR_HOST_ID": str(host),
           # The pods' DNS name of process 0's pod, here: loopback.
           "SIDECAR_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
    pods.append(subprocess.Popen(
        [sys.executable, "-m", "sidecar", "torchrun", "--nproc-per-node", "2", "--",
         sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True))
  outs = []
  try:
    for p in pods:
      outs.append(p.communicate(timeout=120))
  finally:
    for p in pods:
      p.kill()
      p.wait()
  assert [p.returncode for p in pods] == [0, 0], [err[-3000:] for _, err in outs]
  ranks = [[json.loads(line.split("RANK ", 1)[1]) for line in out.splitlines()
            if line.startswith("RANK ")] for out, _ in outs]
  for host, node in enumerate(ranks):
    assert sorted(int(r["LOCAL_RANK"]) for r in node) == [0, 1]
    assert {(r["GROUP_RANK"], r["LOCAL_WORLD_SIZE"], r["WORLD_SIZE"], r["MASTER_PORT"])
            for r in node} == {(str(host), "2", "4", str(port))}
    assert sorted(int(r["RANK"]) for r in node) == [2 * host, 2 * host + 1]
  # Each node's ranks get the platform JAX would pick there; the first line says which.
  here = platform.find_accelerator(environ=NO_PLATFORM)
  assert {r["JAX_PLATFORMS"] for r in ranks[0]} == {None if here else "cpu"}
  assert {r["JAX_PLATFORMS"] for r in ranks[1]} == {None}
  firsts = [err.splitlines()[0] for _, err in outs]
  assert firsts[0].startswith("sidecar torchrun: trainers get "), firsts
  assert firsts[1] == ("sidecar torchrun: trainers get the platform JAX picks (JAX_PLATFORMS "
                       "unset): a tpu is here (TPU_ACCELERATOR_TYPE=v5litepod-8); the sidecars "
                       "run JAX on the CPU")


def test_without_a_job_it_says_what_to_set():
  env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
  p = subprocess.run([sys.executable, "-m", "sidecar", "torchrun", "--", "true"], env=env,
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 2
  assert "the environment names no job" in p.stderr and "SIDECAR_PROCESS_ID" in p.stderr
