"""The offline checks that need no rendered overlay (no kubectl)."""

from __future__ import annotations

import pytest

from sidecar._src.core import errors
from sidecar._src.tools.k8s import checks

pytestmark = pytest.mark.unit


def test_pod_schema_checks_the_default_versions():
  versions = checks.schemas.default_versions()
  assert versions[0] == "1.29"
  assert len(versions) == 2 and tuple(map(int, versions[1].split("."))) > (1, 29)


def test_documents_without_a_jobset_are_reported():
  findings = checks.check_documents([{"apiVersion": "v1", "kind": "ConfigMap"}],
                                    kubernetes_versions=())
  assert [str(f) for f in findings] == [
      "manifests: no JobSet found; pass the rendered JobSet (kubectl kustomize DIR, or sidecar "
      "k8s render)"]


def test_crd_that_is_not_a_crd_is_rejected(tmp_path):
  path = tmp_path / "not-a-crd.yaml"
  path.write_text("apiVersion: v1\nkind: ConfigMap\n")
  with pytest.raises(errors.InvalidArgumentError, match=r"is not a CustomResourceDefinition"):
    checks.check_documents([{"kind": "JobSet"}], crd_path=path)
