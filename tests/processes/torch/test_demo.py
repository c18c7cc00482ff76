"""``sidecar demo --torch``: examples/torch_train.py, 2 ranks under DDP beside 2 sidecars,
trains and saves, then a second job resumes from the last step saved."""

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(700)]


def test_the_torch_demo_trains_saves_and_resumes(tmp_path):
  p = subprocess.run([sys.executable, "-m", "sidecar", "demo", "--torch", "--steps", "20"],
                     cwd=tmp_path, capture_output=True, text=True, timeout=640)
  assert p.returncode == 0, p.stdout + p.stderr
  runs = re.findall(r"trained steps (\d+)-(\d+) on 2 ranks, loss [\d.]+; saved steps \[(.*)\]",
                    p.stdout)
  assert runs == [("0", "19", "19"), ("20", "39", "19, 39")], p.stdout
  assert list(tmp_path.iterdir()) == []  # its temporary directory is gone
