"""A PyTorch-only install: a torch feed and a DCP save and restore through a real
``sidecar serve`` with JAX, jaxlib, Grain, Orbax and TensorStore unimportable, in the
trainer and in the sidecar (issue 36, item 4). Neither process loads any of them; naming
the JAX API says which extra to install.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.support.blocked_imports import SITECUSTOMIZE as _SITECUSTOMIZE
from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


_TRAINER = r'''
import json, sys, warnings

import torch

import sidecar
import sidecar.torch
from sidecar._src.tools.local import LocalCluster
from tests.support.torch_only_fns import Pair

BLOCKED = ("jax", "jaxlib", "grain", "orbax", "tensorstore")
out = {}
imports = ["tests.support.lean_fns", "tests.support.torch_only_fns"]
with LocalCluster(1, 1, imports=imports, shm_size="16MiB", configure_jax=False) as cluster:
  with sidecar.torch.Controller(cluster.addresses, token=cluster.token) as ctl:
    with sidecar.torch.DataLoader("nested", 4, kwargs={"n": 32}, controller=ctl) as loader:
      batches = [b for _, b in zip(range(3), loader)]
    b = batches[1]
    out["keys"] = sorted(b)
    out["types"] = [type(b["z"]).__name__, type(b["pair"]).__name__, type(b["pair"].b).__name__,
                    type(b["a"]).__name__]
    out["z"] = b["z"][:, 0].tolist()
    out["pair"] = [b["pair"].a.tolist(), b["pair"].b[0], b["pair"].b[1].tolist()]
    out["a"] = b["a"][0].tolist()
    out["is_pair"] = type(b["pair"]) is Pair
    ckpt = sidecar.torch.Checkpointer(sys.argv[1], controller=ctl)
    out["is_checkpointer"] = isinstance(ckpt, sidecar.torch.Checkpointer)
    bf16 = torch.bfloat16
    saved = {"w": torch.arange(12.0).reshape(3, 4), "n": {"b": torch.ones(2, dtype=bf16)}}
    out["durable"] = ckpt.save(1, saved).durable.result(60)
    back = ckpt.restore(1, {"w": torch.zeros(3, 4), "n": {"b": torch.zeros(2, dtype=bf16)}})
    out["restored"] = (torch.equal(back["w"], saved["w"])
                       and torch.equal(back["n"]["b"], saved["n"]["b"]))
    ckpt.close()
    out["sidecar_loaded"] = ctl.call("frameworks_loaded")
for name in ("Controller", "Worker"):  # moved to sidecar.jax in 0.2.0: warn, then need JAX
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      getattr(sidecar, name)
    except ImportError as e:
      out[name] = [str(e), *(str(w.message) for w in caught)]
try:
  import sidecar.jax
except ImportError as e:
  out["sidecar.jax"] = str(e)
out["trainer_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps(out))
'''


def test_a_torch_feed_and_checkpoint_run_with_no_jax_grain_orbax_or_tensorstore(tmp_path):
  (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
  run = subprocess.run([sys.executable, "-c", _TRAINER, str(tmp_path / "ckpt")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=240)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.splitlines()[-1])
  hint = "pip install 'colocated-sidecar[jax]'"
  assert out == {
      "keys": ["a", "pair", "z"], "types": ["Tensor", "Pair", "list", "tuple"],
      "z": [4.0, 5.0, 6.0, 7.0], "pair": [[4, 5, 6, 7], None, [-4, -5, -6, -7]],
      "a": [2.0, 2.5, 3.0, 3.5], "is_pair": True, "durable": 1, "restored": True,
      "is_checkpointer": True, "sidecar_loaded": [[]], "trainer_loaded": [],
      "Controller": [
          f"sidecar.Controller (now sidecar.jax.Controller) needs jax, which is not "
          f"installed: {hint}",
          "sidecar.Controller is deprecated since 0.2.0 and goes in 0.3.0: use "
          "sidecar.jax.Controller (PyTorch: sidecar.torch.Controller)"],
      "Worker": [
          f"sidecar.Worker (now sidecar.jax.Worker) needs jax, which is not installed: {hint}",
          "sidecar.Worker is deprecated since 0.2.0 and goes in 0.3.0: use sidecar.jax.Worker"],
      "sidecar.jax": f"sidecar.jax needs jax, which is not installed: {hint}"}


def test_the_blocker_blocks(tmp_path):
  # Guards the test above against passing because nothing was blocked.
  (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
  run = subprocess.run([sys.executable, "-c", "import grain"], env=env, capture_output=True,
                       text=True, timeout=60)
  assert run.returncode == 1 and "No module named 'grain'" in run.stderr
