"""What makes a process a PyTorch-only install: JAX, jaxlib, Grain, Orbax and TensorStore
unimportable (tests/processes/torch/test_no_jax.py, test_cross_format.py)."""

BLOCKED = ("jax", "jaxlib", "grain", "orbax", "tensorstore")

# On PYTHONPATH as sitecustomize: every process of the run (the trainer, LocalCluster's
# sidecars, their feed workers) starts with these packages unimportable, as where they
# are not installed.
SITECUSTOMIZE = f'''
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {BLOCKED!r}:
      raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    return None

sys.meta_path.insert(0, _NotInstalled())
'''
