"""Where the repository and the tests' data are, for tests at any depth."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


def entries(directory) -> list[str]:
  """The sorted names in a checkpoint ``directory``, less the job's goodput ledger
  (``goodput.jsonl``, docs/goodput.md) and the lock files of the jobs that opened it
  (``.sidecar-jobs/``, docs/concepts.md), which lie beside the steps."""
  import os
  return sorted(name for name in os.listdir(directory)
                if name not in ("goodput.jsonl", ".sidecar-jobs"))
