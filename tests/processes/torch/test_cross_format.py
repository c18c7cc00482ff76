"""A checkpoint opened by the other framework's checkpointer (issue 55, item 4): a PyTorch
DCP step restored by ``sidecar.jax``'s, an Orbax step by ``sidecar.torch``'s on a
PyTorch-only install. Each fails before its reader runs, naming the format found and
the API that reads it, never "restore it with Orbax" or DCP's ``metadata is None``.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import torch

import sidecar
import sidecar.torch
from tests.support.blocked_imports import SITECUSTOMIZE as _SITECUSTOMIZE
from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_a_dcp_step_restored_by_sidecar_jax_names_dcp_and_its_readers(tmp_path):
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB") as c:
    with sidecar.torch.Controller(c.addresses, token=c.token) as tctl:
      with sidecar.torch.Checkpointer(tmp_path, controller=tctl) as ckpt:
        ckpt.save(3, {"w": torch.ones(4)}).durable.result(60)
    with c.controller() as ctl, ctl.checkpointer(tmp_path) as ckpt:
      assert ckpt.all_steps() == [3]
      with pytest.raises(sidecar.WrongFormatError, match=re.escape(
          f"step 3 in {tmp_path} is a PyTorch DCP checkpoint (.metadata, __0_0.distcp); "
          "restore it with sidecar.torch.Checkpointer or torch.distributed.checkpoint.load")):
        ckpt.restore(3, target={"w": jax.ShapeDtypeStruct((4,), jnp.float32)})


_TORCH_ONLY = r'''
import json, sys

import torch

import sidecar, sidecar.torch
from sidecar._src.tools.local import LocalCluster

out = {}
with LocalCluster(1, 1, shm_size="16MiB", configure_jax=False) as cluster:
  with sidecar.torch.Controller(cluster.addresses, token=cluster.token) as ctl:
    with sidecar.torch.Checkpointer(sys.argv[1], controller=ctl) as ckpt:
      out["steps"] = ckpt.all_steps()
      try:
        ckpt.restore(3, {"w": torch.zeros(4)})
      except Exception as e:
        out["error"] = [type(e).__name__, str(e)]
  out["log"] = cluster.log(0)
print(json.dumps(out))
'''


def test_an_orbax_step_restored_by_sidecar_torch_without_jax_names_orbax(tmp_path):
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB") as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
      ckpt.save(3, {"w": jnp.ones(4)}).durable.result(60)
  (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)  # no JAX, Orbax, TensorStore
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
  run = subprocess.run([sys.executable, "-c", _TORCH_ONLY, str(tmp_path / "ck")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=240)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.splitlines()[-1])
  assert out["steps"] == [3]
  assert out["error"] == [
      "WrongFormatError",
      f"step 3 in {tmp_path / 'ck'} is an Orbax checkpoint (_CHECKPOINT_METADATA, default/); "
      "restore it with ctl.checkpointer (sidecar.jax) or orbax.checkpoint"]
  assert "tensorstore" not in out["log"] and "metadata is None" not in run.stderr
