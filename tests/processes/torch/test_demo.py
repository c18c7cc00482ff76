"""``sidecar demo --torch``: examples/torch_train.py, 2 ranks under DDP beside 2 sidecars,
trains and saves, then a second job resumes from the last step saved; with no JAX in any
process."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(700)]

# Started first in every Python process (the demo, the launcher's sidecars and its trainers
# inherit PYTHONPATH): JAX and its kin cannot be imported, as if not installed.
NO_JAX = """\
import sys
for name in ("jax", "jaxlib", "grain", "orbax", "tensorstore"):
  sys.modules[name] = None
"""


def test_the_torch_demo_trains_saves_and_resumes_with_no_jax_in_any_process(tmp_path):
  shim, work = tmp_path / "shim", tmp_path / "work"
  shim.mkdir()
  work.mkdir()
  (shim / "sitecustomize.py").write_text(NO_JAX)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(shim), *filter(None, [os.environ.get("PYTHONPATH")])]))
  blocked = subprocess.run([sys.executable, "-c", "import jax"], env=env, capture_output=True,
                           text=True, timeout=60)
  assert "ModuleNotFoundError: import of jax halted" in blocked.stderr  # the shim holds
  # Before: pipelines.digits imports Grain, which brings JAX: every sidecar failed at start.
  p = subprocess.run([sys.executable, "-m", "sidecar", "demo", "--torch", "--steps", "20"],
                     cwd=work, env=env, capture_output=True, text=True, timeout=640)
  assert p.returncode == 0, p.stdout + p.stderr
  runs = re.findall(r"trained steps (\d+)-(\d+) on 2 ranks, loss [\d.]+; saved steps \[(.*)\]",
                    p.stdout)
  assert runs == [("0", "19", "19"), ("20", "39", "19, 39")], p.stdout
  assert "JAX_PLATFORMS" not in p.stdout + p.stderr  # sidecar launch --torch: not a JAX job
  assert list(work.iterdir()) == []  # its temporary directory is gone
