"""examples/torch_train.py under ``sidecar launch --torch``: --steps is a global step."""

import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


def test_one_rank_trains_to_the_global_step_asked(tmp_path):
  """Issue 79 item 5: one rank (--hosts 1) died at dist.get_rank() (no process group:
  connect() starts one only for several ranks); --steps is the global step it trains to
  (tests/unit/test_examples.py: a resumed run trains the steps left)."""
  p = subprocess.run(
      [sys.executable, "-m", "sidecar", "launch", "--torch", "--hosts", "1",
       "--shm-size", "32MiB", "--import", "pipelines.digits_iterable", "--",
       sys.executable, "examples/torch_train.py", "--steps", "20", "--dir",
       str(tmp_path / "ckpt")],
      cwd=ROOT, capture_output=True, text=True, timeout=240,
      env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert p.returncode == 0, p.stdout + p.stderr
  assert re.findall(r"trained steps (\d+)-(\d+) on 1 ranks", p.stdout) == [("0", "19")], (
      p.stdout)
