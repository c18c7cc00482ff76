"""What importing the public API loads, in a fresh interpreter: neither Orbax nor TensorStore."""

import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.processes


_PROBE = """
import sys
import sidecar
ctl = sidecar.jax.Controller  # the whole public API, controller and checkpointer included
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"orbax", "tensorstore"})
print("loaded:", loaded)
"""


def test_the_public_api_loads_neither_orbax_nor_tensorstore():
  # They cost ~1.5 s of `import sidecar`, in every trainer (re)start; only the sidecars,
  # which write and read the files, and sidecar.orbax (the Orbax handler) need them.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                       text=True, timeout=120, check=True).stdout
  assert out.strip() == "loaded: []"
