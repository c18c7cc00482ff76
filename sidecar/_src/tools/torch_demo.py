"""``sidecar demo --torch``: examples/torch_train.py as 2 ranks beside 2 sidecars, twice.

The first run trains from scratch and saves DCP checkpoints through the sidecars; the
second, a new job beside new sidecars, resumes from the last step saved (from storage,
the sidecars' RAM tiers being new), with the data where it stopped. Both run under
``sidecar launch --torch`` in a temporary directory, which is removed afterwards; no
process of it imports JAX (``pip install 'colocated-sidecar[torch,digits]'`` is enough).
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys
import tempfile

from sidecar._src.tools import launch

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "torch_train.py"
# The digits without Grain: neither the sidecars nor the trainers import JAX.
PIPELINES = "pipelines.digits_iterable"


def run(*, hosts: int = 2, steps: int = 60) -> int:
  """Runs the example twice; returns the launcher's exit code (0 when both succeed)."""
  missing = [m for m in ("torch", "sklearn") if importlib.util.find_spec(m) is None]
  if missing:
    print(f"sidecar demo --torch needs {' and '.join(missing)}: "
          "pip install 'colocated-sidecar[torch,digits]'", file=sys.stderr)
    return 1
  if not EXAMPLE.is_file():
    print(f"sidecar demo --torch runs {EXAMPLE}, which this install does not have: run it "
          "from a checkout of the repository (pip install -e .)", file=sys.stderr)
    return 1
  work = tempfile.mkdtemp(prefix="sidecar-torch-demo-")
  try:
    for run_number, what in ((1, "train from scratch"),
                             (2, f"resume from their checkpoint, {steps} steps more")):
      print(f"--- run {run_number}: {hosts} ranks beside {hosts} sidecars {what}", flush=True)
      # --steps is the step to train until, counted across runs
      code = launch.run([sys.executable, str(EXAMPLE), "--steps", str(run_number * steps),
                         "--dir", str(pathlib.Path(work) / "ckpt")], hosts=hosts,
                        imports=[PIPELINES], shm_size="64MiB", torch=True)
      if code:
        return code
    return 0
  finally:
    shutil.rmtree(work, ignore_errors=True)
