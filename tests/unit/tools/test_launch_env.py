"""The environment sidecar launch gives its trainers: one job name per launch (issue 62
item 5), the same in every trainer and every restart, so that their checkpoint directory
is held by one job and a restart takes it over at once."""

import types

import pytest

from sidecar._src.core import env as env_lib, job as job_lib
from sidecar._src.tools import launch_env

pytestmark = pytest.mark.unit

CLUSTER = types.SimpleNamespace(num_hosts=2, devices_per_host=1,
                                socket=lambda h: f"/tmp/s{h}.sock",
                                host_entry=lambda h: f"unix:/tmp/s{h}.grpc",
                                scratch=lambda name: f"/tmp/{name}", token=None)


def _env(host, restart, base=None):
  return launch_env.trainer_env(CLUSTER, host, "127.0.0.1:1", base or {}, restart=restart,
                                max_restarts=3)


def test_every_trainer_and_restart_of_a_launch_is_one_job_named_by_its_launcher():
  names = {_env(h, r)[env_lib.JOB] for h in (0, 1) for r in (0, 1, 2)}
  assert names == {launch_env.JOB}
  assert launch_env.JOB.startswith("sidecar launch ") and "(pid " in launch_env.JOB
  assert job_lib.name_of(_env(0, 0)) == launch_env.JOB


def test_a_job_name_given_to_the_launch_is_kept():
  assert _env(0, 1, {env_lib.JOB: "nightly run 7"})[env_lib.JOB] == "nightly run 7"


@pytest.mark.parametrize("environ, name", [
    ({"SLURM_JOB_ID": "4242"}, "slurm job 4242"),
    ({"SIDECAR_JOBSET_NAME": "train"}, "jobset train"),
    ({"SIDECAR_JOB": "mine", "SLURM_JOB_ID": "4242"}, "mine"),
    ({}, None)], ids=["slurm", "jobset", "given", "none"])
def test_a_jobs_name_from_its_environment(environ, name):
  assert job_lib.name_of(environ) == name
