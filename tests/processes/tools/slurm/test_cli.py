"""``sidecar slurm`` refuses bad arguments before anything runs (no Slurm needed)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes


def test_the_cli_refuses_a_bad_split_before_anything_runs():
  done = subprocess.run([sys.executable, "-m", "sidecar", "slurm", "batch",
                         "--ntasks-per-node", "3", "--hosts-per-node", "2", "--", "true"],
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 2
  assert "--hosts-per-node 2 does not divide --ntasks-per-node 3" in done.stderr
