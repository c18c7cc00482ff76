"""One-host jobs on the accelerator host, as a user starts them there: ``sidecar launch
--hosts 1`` and the multi-process example beside ``sidecar local``. That host allows no TCP
socket and has no metadata server, though JAX detects a Cloud TPU on it: neither may need
``jax.distributed``."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.accelerator.conftest import DRY_RUN

pytestmark = pytest.mark.accelerator

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"
# The example as written, then the platform its trainer had.
RUN = ("import jax, runpy, sys; sys.argv = ['train_multiprocess.py', sys.argv[1]]; "
       "runpy.run_path('train_multiprocess.py', run_name='__main__'); "
       "print('trainer platform:', jax.devices()[0].platform)")


def _env() -> dict[str, str]:
  return {k: v for k, v in os.environ.items()
          if k != "XLA_FLAGS" and (k != "JAX_PLATFORMS" or DRY_RUN)}


@pytest.mark.timeout(600)
def test_sidecar_launch_runs_a_one_host_job_on_the_chip(tmp_path, accelerator):
  done = subprocess.run(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--import", "quickstart_fns",
       "--checkpoint-root", str(tmp_path), "--", sys.executable, "-c", RUN,
       str(tmp_path / "run1")],
      cwd=EXAMPLES, env=_env(), capture_output=True, text=True, timeout=500)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "[host 0] 1 process(es): trained steps 0-99; saved steps [49, 74, 99]" in done.stdout
  assert f"[host 0] trainer platform: {accelerator['platform']}" in done.stdout, done.stdout


@pytest.mark.timeout(600)
def test_the_multiprocess_example_beside_sidecar_local_runs_as_one_process(tmp_path,
                                                                           accelerator):
  local = subprocess.Popen(
      [sys.executable, "-m", "sidecar", "local", "--hosts", "1", "--import", "quickstart_fns",
       "--checkpoint-root", str(tmp_path)],
      cwd=EXAMPLES, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    hosts = None
    for line in local.stdout:
      if m := re.fullmatch(r"SIDECAR_HOSTS=(\S+)\n", line):
        hosts = m.group(1)
        break
    assert hosts, "sidecar local printed no SIDECAR_HOSTS line"
    done = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "run1")], cwd=EXAMPLES,
                          env={**_env(), "SIDECAR_HOSTS": hosts}, capture_output=True,
                          text=True, timeout=400)
  finally:
    local.terminate()
    local.wait(timeout=60)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "1 process(es): trained steps 0-99" in done.stdout, done.stdout
  assert f"trainer platform: {accelerator['platform']}" in done.stdout
