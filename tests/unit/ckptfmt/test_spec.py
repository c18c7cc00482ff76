"""ckptfmt.spec: Orbax's names, without importing Orbax (shardings: tests/unit/jax/test_checkpoint.py)."""

import os
import subprocess
import sys

import pytest
from orbax.checkpoint._src.path import atomicity_types

from sidecar._src.ckptfmt import spec as layout_spec
from tests.unit.test_layers import ROOT

pytestmark = pytest.mark.unit


def test_the_names_are_orbaxs():
  assert layout_spec.TMP_SUFFIX == atomicity_types.TMP_DIR_SUFFIX
  assert layout_spec.COMMIT_SUCCESS_FILE == atomicity_types.COMMIT_SUCCESS_FILE


_PROBE = """
import sys
import sidecar
ctl = sidecar.Controller  # the whole public API, controller and checkpointer included
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"orbax", "tensorstore"})
print("loaded:", loaded)
"""


@pytest.mark.processes
def test_the_public_api_loads_neither_orbax_nor_tensorstore():
  # They cost ~1.5 s of `import sidecar`, in every trainer (re)start; only the sidecars,
  # which write and read the files, and sidecar.orbax (the Orbax handler) need them.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                       text=True, timeout=120, check=True).stdout
  assert out.strip() == "loaded: []"
