"""sidecar torchrun's flags: a node per process of the job the SIDECAR_* variables name."""

import pytest

from sidecar._src.core import errors
from sidecar._src.tools.torchrun import node_args
from tests.support.jobset_env import JOBSET_ENV

pytestmark = pytest.mark.unit


def flags(args: list[str]) -> dict[str, str]:
  return dict(zip(args[::2], args[1::2]))


def test_a_jobset_pod_is_the_node_of_its_process_and_process_0s_pod_the_master():
  pod = {**JOBSET_ENV, "SIDECAR_SLICE_ID": "1", "SIDECAR_HOST_ID": "2",
         "SIDECAR_COORDINATOR_PORT": "9000"}
  assert flags(node_args(pod, 8)) == {
      "--nnodes": "6", "--node-rank": "5", "--nproc-per-node": "8",
      "--master-addr": "train-slice-0-0.train", "--master-port": "9000"}


def test_the_sidecar_launchers_job_names_the_nodes_too():
  env = {"SIDECAR_COORDINATOR_ADDRESS": "[fd00::1]:8476", "SIDECAR_NUM_PROCESSES": "3",
         "SIDECAR_PROCESS_ID": "0"}
  assert flags(node_args(env, 2)) == {
      "--nnodes": "3", "--node-rank": "0", "--nproc-per-node": "2", "--master-addr": "fd00::1",
      "--master-port": "8476"}


def test_a_job_of_one_node_without_a_coordinator_is_standalone():
  env = {"SIDECAR_NUM_PROCESSES": "1", "SIDECAR_PROCESS_ID": "0"}
  assert node_args(env, 4) == ["--standalone", "--nnodes", "1", "--node-rank", "0",
                               "--nproc-per-node", "4"]


@pytest.mark.parametrize("env, nproc, match", [
    ({}, 2, "the environment names no job.*SIDECAR_COORDINATOR_ADDRESS"),
    ({**JOBSET_ENV, "SIDECAR_SLICE_ID": "0", "SIDECAR_HOST_ID": "0"}, 0,
     "--nproc-per-node must be an integer >= 1, got 0"),
    ({**JOBSET_ENV, "SIDECAR_SLICE_ID": "0"}, 1, "SIDECAR_HOST_ID"),
], ids=["no-job", "no-procs", "half-a-pod"])
def test_what_names_no_node_is_refused_naming_the_fix(env, nproc, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    node_args(env, nproc)
