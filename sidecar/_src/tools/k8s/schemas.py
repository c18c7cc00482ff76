"""Schema validation, offline: JobSets against the JobSet CRD, pod templates as Pods.

The JobSet CRD's ``openAPIV3Schema`` lets unknown fields through (the API server prunes
them); :func:`strict_schema` closes every object that lists its properties, so a typo such
as ``initContainer`` is an error here. Pod templates are checked with ``kubernetes-validate
--strict``, which knows each Kubernetes release's Pod schema.

``jsonschema`` and ``kubernetes-validate`` are only needed here; importing this module
without them works, using it says what to install.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from sidecar._src.core import errors

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
MIN_KUBERNETES = "1.29"  # native sidecar containers


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
  """One problem in a manifest: where it is and what to do about it."""
  where: str
  message: str

  def __str__(self) -> str:
    return f"{self.where}: {self.message}"


def _require(module: str, package: str) -> Any:
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f"checking manifests needs {package}: pip install {package}") from e


def yaml_loader() -> type:
  """PyYAML's C loader when built with libyaml (10x faster on the 800 kB CRD)."""
  return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def strict_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
  """A copy of an OpenAPI v3 schema in which objects with properties reject unknown fields.

  Objects that are maps (``additionalProperties``) or free-form
  (``x-kubernetes-preserve-unknown-fields``) stay open.
  """
  def close(node: Any) -> None:
    if isinstance(node, dict):
      if ("properties" in node and "additionalProperties" not in node
          and not node.get("x-kubernetes-preserve-unknown-fields")):
        node["additionalProperties"] = False
      for value in node.values():
        close(value)
    elif isinstance(node, list):
      for value in node:
        close(value)

  result = copy.deepcopy(dict(schema))
  close(result)
  return result


@functools.lru_cache(maxsize=4)
def load_jobset_schema(crd_path: str | pathlib.Path, version: str = "v1alpha2") -> dict:
  """The strict ``openAPIV3Schema`` of ``version`` from a JobSet CRD file.

  Get the CRD from a JobSet release, or from your cluster with
  ``kubectl get crd jobsets.jobset.x-k8s.io -o yaml``.
  """
  with open(crd_path, encoding="utf-8") as f:
    crd = yaml.load(f, Loader=yaml_loader())
  if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
    raise errors.InvalidArgumentError(
        f"{crd_path} is not a CustomResourceDefinition; pass the JobSet CRD "
        "(jobsets.jobset.x-k8s.io)")
  versions = {v.get("name"): v for v in crd.get("spec", {}).get("versions", [])}
  if version not in versions:
    raise errors.InvalidArgumentError(
        f"{crd_path} has no version {version!r} (it has {sorted(versions)}); use a JobSet "
        "CRD that serves jobset.x-k8s.io/v1alpha2")
  return strict_schema(versions[version]["schema"]["openAPIV3Schema"])


def validate_jobset(jobset: Mapping[str, Any], schema: Mapping[str, Any]) -> list[Finding]:
  """Every way ``jobset`` breaks the (strict) JobSet schema."""
  jsonschema = _require("jsonschema", "jsonschema")
  name = _name(jobset)
  findings = []
  if jobset.get("apiVersion") != JOBSET_API_VERSION:
    findings.append(Finding(name, f"apiVersion is {jobset.get('apiVersion')!r}; this schema "
                                  f"is for {JOBSET_API_VERSION}"))
  validator = jsonschema.Draft7Validator(schema)
  for error in sorted(validator.iter_errors(jobset), key=lambda e: list(map(str, e.path))):
    findings.append(Finding(f"{name}: {path_text(error.absolute_path)}",
                            f"JobSet schema: {error.message}"))
  return findings


def validate_pod(template: Mapping[str, Any], where: str,
                 versions: Sequence[str] | None = None) -> list[Finding]:
  """Validates a pod template as a Pod with ``kubernetes-validate --strict``.

  Args:
    template: a pod template (``metadata`` and ``spec``).
    where: the template's place, for messages.
    versions: Kubernetes versions to check; default the oldest the sidecar supports
      (1.29) and the newest that kubernetes-validate knows.
  """
  kv = _require("kubernetes_validate", "kubernetes-validate")
  if versions is None:
    versions = default_versions()
  pod = {
      "apiVersion": "v1",
      "kind": "Pod",
      "metadata": dict(template.get("metadata") or {}, name="pod"),
      "spec": template.get("spec"),
  }
  findings = []
  for version in versions:
    try:
      kv.validate(pod, version, strict=True)
    except kv.ValidationError as e:
      findings.append(Finding(f"{where}.{path_text(e.path)}",
                              f"Pod schema (Kubernetes {version}, strict): {e.message}"))
  return findings


def validate_object(doc: Mapping[str, Any], versions: Sequence[str] | None = None
                    ) -> list[Finding]:
  """Validates a built-in object (a StatefulSet, a Service, a Job) with
  ``kubernetes-validate --strict`` at ``versions`` (default as :func:`validate_pod`)."""
  kv = _require("kubernetes_validate", "kubernetes-validate")
  if versions is None:
    versions = default_versions()
  findings = []
  for version in versions:
    try:
      kv.validate(dict(doc), version, strict=True)
    except kv.ValidationError as e:
      findings.append(Finding(f"{_name(doc)}: {path_text(e.path)}",
                              f"{doc.get('kind')} schema (Kubernetes {version}, strict): "
                              f"{e.message}"))
  return findings


def default_versions() -> tuple[str, ...]:
  """Kubernetes 1.29 and the newest version kubernetes-validate knows."""
  kv = _require("kubernetes_validate", "kubernetes-validate")
  latest = ".".join(kv.latest_version().split(".")[:2])
  return tuple(dict.fromkeys((MIN_KUBERNETES, latest)))


def path_text(path: Sequence[Any]) -> str:
  """``["spec", "containers", 0, "name"]`` as ``spec.containers[0].name``."""
  text = ""
  for part in path:
    text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
  return text or "(top)"


def _name(doc: Mapping[str, Any]) -> str:
  name = (doc.get("metadata") or {}).get("name", "?")
  return f"{doc.get('kind', '?')} {name}"
