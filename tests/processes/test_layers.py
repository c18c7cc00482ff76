"""The layers at run time: importing the sidecar server loads no controller module."""

import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.processes


# Imports sidecar._src.* for real, with the `sidecar` package's __init__ (the public
# API, which loads the controller for users) replaced by an empty package.
_PROBE = """
import sys, types
pkg = types.ModuleType("sidecar")
pkg.__path__ = [sys.argv[1]]
sys.modules["sidecar"] = pkg
def controller():
  return sorted(m for m in sys.modules if m.startswith("sidecar._src.controller"))
import sidecar._src.server.server
print("after server:", controller())
import sidecar._src.tools.demo  # imports the controller at its top: the probe sees such loads
print("after demo:", bool(controller()))
"""


def test_importing_the_sidecar_server_loads_no_controller_module():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT / "sidecar")], env=env,
                       capture_output=True, text=True, timeout=120, check=True).stdout
  assert out.splitlines() == ["after server: []", "after demo: True"]
