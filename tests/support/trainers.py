"""The test trainers: running train.py as one process, and the ``RESULT {...}`` lines they print."""

import json
import os
import re
import subprocess
import sys

from tests.support.paths import ROOT


def results(output: str) -> list[dict]:
  """The ``RESULT {...}`` lines of a trainer's output (train.py, train_elastic.py), parsed."""
  return [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", output)]


def single(directory, scenario: str) -> list[dict]:
  """Runs the trainer as one process that owns every device (a LocalCluster of 2 hosts)."""
  done = subprocess.run([sys.executable, "-m", "tests.support.train", "single",
                         str(directory), scenario], cwd=ROOT, capture_output=True, text=True,
                        timeout=240, env={**os.environ, "XLA_FLAGS": ""})
  assert done.returncode == 0, done.stdout + done.stderr
  return results(done.stdout)


def by_process(results: list[dict], process: int) -> list[dict]:
  return [{k: v for k, v in r.items() if k != "process"} for r in results
          if r["process"] == process]


def without(results: list[dict], *kinds: str) -> list[dict]:
  return [r for r in results if r["kind"] not in kinds]
