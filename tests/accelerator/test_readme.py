"""The README's quick start on the accelerator host: its two runs, the trainer on the chip."""

import os
import subprocess
import sys

import pytest

from tests.accelerator.conftest import DRY_RUN
from tests.support import readme

pytestmark = pytest.mark.accelerator

# train.py as written, then the platform its trainer had: the one JAX picks on this host.
RUN = ("import jax, runpy; runpy.run_path('train.py', run_name='__main__'); "
       "print('trainer platform:', jax.devices()[0].platform)")


@pytest.mark.timeout(900)  # two trainers that open the chip (~15 s each there) and 2 sidecars
def test_the_quick_start_runs_as_written_on_the_chip_and_a_rerun_resumes(tmp_path, accelerator):
  files = readme.quick_start()
  assert sorted(files) == ["my_pkg/sidecar_fns.py", "train.py"]
  for name, source in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(source)
  (tmp_path / "my_pkg" / "__init__.py").write_text("")
  # As a user's shell on that host (its PYTHONPATH finds the project, docs/tpu.md): no
  # XLA_FLAGS, no JAX_PLATFORMS (a dry run keeps its cpu).
  env = {k: v for k, v in os.environ.items()
         if k != "XLA_FLAGS" and (k != "JAX_PLATFORMS" or DRY_RUN)}
  outputs = []
  for _ in range(2):
    done = subprocess.run([sys.executable, "-c", RUN], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    outputs.append(done.stdout)
  readme.check_two_runs(outputs, tmp_path)
  assert f"trainer platform: {accelerator['platform']}" in outputs[1], outputs[1]
