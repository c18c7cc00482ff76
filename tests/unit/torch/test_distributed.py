"""A torch rank that torchrun did not start: torchrun's variables from Slurm's (a task of
plain ``srun``) or from a JobSet pod's ``SIDECAR_*`` job (no Slurm, no Kubernetes here)."""

import pytest

from sidecar._src.core import errors
from sidecar._src.torch import distributed
from tests.support.jobset_env import JOBSET_ENV

pytestmark = pytest.mark.unit

STEP = {  # task 3 of a 4-task srun step over 2 nodes, as slurmstepd sets it
    "SLURM_JOB_ID": "1234567", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "4"}


def test_an_srun_task_gets_its_rank_and_rank_0s_node_and_a_port_from_the_job():
  assert distributed.launcher_env(STEP) == {
      "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "GROUP_RANK": "1", "MASTER_ADDR": "gpu07", "MASTER_PORT": str(15000 + 4567)}
  assert distributed.ranks(STEP) == distributed.Ranks(
      rank=3, world_size=4, local_rank=1, local_world_size=2, group_rank=1)


@pytest.mark.parametrize("environ", [
    {**STEP, "RANK": "0", "WORLD_SIZE": "1"},  # torchrun's, or sidecar slurm batch's, win
    {k: v for k, v in STEP.items() if k != "SLURM_STEP_NUM_TASKS"},  # the batch script itself
    {},  # no Slurm
])
def test_torchruns_variables_or_no_srun_step_take_nothing_from_slurm(environ):
  assert distributed.launcher_env(environ) == {}


def test_what_the_script_set_itself_stays():
  env = {**STEP, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
  out = distributed.launcher_env(env)
  assert "MASTER_ADDR" not in out and "MASTER_PORT" not in out and out["RANK"] == "3"


@pytest.mark.parametrize("nodelist,first", [
    ("n1", "n1"), ("gpu[03-05,9],login", "gpu03"), ("a[1-2]-ib[3-4],b", "a1-ib3"),
    ("node-[001-004]", "node-001"), ("x,y[1-2]", "x")])
def test_the_first_node_of_a_slurm_host_list(nodelist, first):
  assert distributed.first_node(nodelist) == first


def test_a_bad_task_count_is_named():
  with pytest.raises(errors.InvalidArgumentError, match="WORLD_SIZE must be an integer"):
    distributed.ranks({**STEP, "SLURM_STEP_NUM_TASKS": "four"})


def test_a_jobset_pod_is_one_rank_whose_master_is_process_0s_pod():
  # Pod (slice 1, host 2) of 2 slices of 3 hosts, as the manifests' env gives it.
  pod = {**JOBSET_ENV, "SIDECAR_SLICE_ID": "1", "SIDECAR_HOST_ID": "2",
         "SIDECAR_COORDINATOR_PORT": "8476"}
  assert distributed.launcher_env(pod) == {
      "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
      "GROUP_RANK": "5", "MASTER_ADDR": "train-slice-0-0.train", "MASTER_PORT": "8476"}
  with pytest.raises(errors.InvalidArgumentError, match="SIDECAR_SLICE_ID nor SIDECAR_HOST_ID"):
    distributed.launcher_env(JOBSET_ENV)  # a pod without its identity: named


def test_sidecar_launchs_job_without_torch_gives_the_ranks_too():
  env = {"SIDECAR_COORDINATOR_ADDRESS": "127.0.0.1:4000", "SIDECAR_NUM_PROCESSES": "2",
         "SIDECAR_PROCESS_ID": "1"}
  out = distributed.launcher_env(env)
  assert (out["RANK"], out["WORLD_SIZE"], out["MASTER_ADDR"], out["MASTER_PORT"]) == (
      "1", "2", "127.0.0.1", "4000")
