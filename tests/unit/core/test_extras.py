"""Tier 1: a missing optional dependency's error names the extra that installs it."""

import pytest

from sidecar._src.core import extras

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("module, extra", [
    ("jax", "jax"), ("jaxlib.xla_client", "jax"), ("grain", "jax"), ("orbax.checkpoint", "jax"),
    ("tensorstore", "jax"), ("torch.distributed", "torch"),
], ids=["jax", "jaxlib", "grain", "orbax", "tensorstore", "torch"])
def test_a_missing_frameworks_error_names_its_extra(module, extra):
  e = ModuleNotFoundError(f"No module named {module!r}", name=module)
  out = extras.missing(e, "sidecar.Thing")
  assert isinstance(out, ModuleNotFoundError) and out.name == module
  with pytest.raises(ModuleNotFoundError, match=(
      rf"^sidecar.Thing needs {module}, which is not installed: "
      rf"pip install 'colocated-sidecar\[{extra}\]'$")):
    raise out


def test_a_module_no_extra_brings_keeps_its_error():
  e = ModuleNotFoundError("No module named 'my_pkg'", name="my_pkg")
  assert extras.missing(e, "sidecar.Thing") is e
  # jax is there and fails: no missing extra
  other = ImportError("cannot import name 'x' from 'jax'", name="jax")
  assert extras.missing(other, "sidecar.Thing") is other
