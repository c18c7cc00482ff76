"""Checks of a shared pool's manifests (k8s/pool, docs/pool.md), offline.

A pool is a StatefulSet of sidecars each running ``sidecar serve --pool FILE``, behind a
headless Service that gives every pod a DNS name (``<set>-N.<service>``), with the pool
file in a Secret. Jobs reach it with ``SIDECAR_HOSTS`` and ``Controller.from_env()``.
:func:`check_pool` finds what would break that: the pool file outside the Secret, or
readable by others; a Service that is not headless or does not select the pods; a host id
that is not the pod's ordinal; an arena above the memory limit; probes off the health port;
an operator token (``--operator-token-file``) outside a Secret, or one others may read.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sidecar._src.core import options as options_lib
from sidecar._src.tools.k8s import checks, schemas
from sidecar._src.tools.k8s.schemas import Finding

POOL_FLAG = "--pool"
OPERATOR_FLAG = "--operator-token-file"
# A StatefulSet pod's ordinal (Kubernetes >= 1.28): the sidecar's host id.
ORDINAL_REF = "metadata.labels['apps.kubernetes.io/pod-index']"
_OTHERS = 0o007  # permission bits of everyone else


def pool_sets(docs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
  """The StatefulSets and DaemonSets in ``docs`` whose pods run ``sidecar serve --pool``."""
  return [d for d in docs if isinstance(d, Mapping)
          and d.get("kind") in ("StatefulSet", "DaemonSet") and _pool_sidecar(d) is not None]


def check_pool(docs: Sequence[Mapping[str, Any]], *,
               kubernetes_versions: Sequence[str] | None = None) -> list[Finding]:
  """Every finding for the pools in ``docs`` (their Services among ``docs`` too).

  ``kubernetes_versions``: versions to validate the objects at (strict schemas); default
  1.29 and the newest kubernetes-validate knows; empty skips the schemas.
  """
  findings: list[Finding] = []
  services = {str((s.get("metadata") or {}).get("name")): s for s in docs
              if isinstance(s, Mapping) and s.get("kind") == "Service"}
  for doc in pool_sets(docs):
    where = schemas._name(doc)
    if kubernetes_versions is None or kubernetes_versions:
      findings += schemas.validate_object(doc, kubernetes_versions)
    findings += _check_set(doc, where, services)
  if kubernetes_versions is None or kubernetes_versions:
    for service in services.values():
      findings += schemas.validate_object(service, kubernetes_versions)
  return findings


def _pool_sidecar(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
  spec = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
  for c in list(spec.get("initContainers") or []) + list(spec.get("containers") or []):
    argv = [str(a) for a in list(c.get("command") or []) + list(c.get("args") or [])]
    if "serve" in argv and any(a == POOL_FLAG or a.startswith(POOL_FLAG + "=") for a in argv):
      return c
  return None


def _check_set(doc: Mapping[str, Any], where: str,
               services: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
  spec = doc.get("spec") or {}
  template = spec.get("template") or {}
  pod = template.get("spec") or {}
  sidecar = _pool_sidecar(doc)
  assert sidecar is not None
  swhere = f"{where}: spec.template.spec.containers[name={sidecar.get('name')}]"
  findings = _check_pool_file(sidecar, pod, swhere)
  findings += checks._check_memory(sidecar, swhere)
  findings += _check_probes(sidecar, swhere)
  if doc.get("kind") == "StatefulSet":
    port = int(checks._setting(sidecar, "--port", "SIDECAR_PORT", options_lib.DEFAULT_PORT)
               or 0)
    findings += _check_service(spec, template, where, services, port)
    findings += _check_replica_hosts(doc, sidecar, swhere, port)
    host_id = next((e for e in sidecar.get("env") or [] if e.get("name") == "SIDECAR_HOST_ID"),
                   None)
    ref = ((host_id or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
    if ref != ORDINAL_REF:
      findings.append(Finding(f"{swhere}.env[SIDECAR_HOST_ID]",
                              f"must come from the pod's ordinal ({ORDINAL_REF}), so that "
                              "sidecar-pool-N is host N, the N-th of SIDECAR_HOSTS"))
  return findings


def _check_replica_hosts(doc: Mapping[str, Any], sidecar: Mapping[str, Any], swhere: str,
                         port: int) -> list[Finding]:
  """SIDECAR_REPLICA_HOSTS, where set, lists the set's own pods in ordinal order: the only
  places its sidecars send a tenant's replicas to (issue 42)."""
  given = next((e.get("value") for e in sidecar.get("env") or []
                if e.get("name") == "SIDECAR_REPLICA_HOSTS"), None)
  if given is None:
    return []
  spec = doc.get("spec") or {}
  name, service = (doc.get("metadata") or {}).get("name"), spec.get("serviceName")
  want = ",".join(f"{name}-{i}.{service}:{port}" for i in range(int(spec.get("replicas", 1))))
  if str(given).replace(" ", "") != want:
    return [Finding(f"{swhere}.env[SIDECAR_REPLICA_HOSTS]",
                    f"is {given!r}, not the set's own pods by ordinal ({want}): a replica "
                    "would go to a host id's wrong pod, or none; list every pod of replicas:")]
  return []


def _check_pool_file(sidecar: Mapping[str, Any], pod: Mapping[str, Any],
                     swhere: str) -> list[Finding]:
  path = str(checks._setting(sidecar, POOL_FLAG, "", None) or "")
  findings = _check_secret_file(
      sidecar, pod, swhere, path, what="the pool file", readers="the pool file and the "
      "tenants' tokens", fix="mount the Secret that holds it (and the tenants' token files "
      "beside it) and pass its path to --pool")
  # The pool's operator token (every tenant's Status row), where the pool file names none:
  # a Secret of its own, kept as the tenants' tokens are (issue 42).
  operator = str(checks._setting(sidecar, OPERATOR_FLAG, "", None) or "")
  if operator:
    findings += _check_secret_file(
        sidecar, pod, swhere, operator, what="the pool's operator token",
        readers="the operator token (every tenant's Status row)", fix="make a Secret of "
        "it (kubectl create secret generic sidecar-operator-token --from-literal=token=...), "
        f"mount it and pass its path to {OPERATOR_FLAG}")
  return findings


def _check_secret_file(sidecar: Mapping[str, Any], pod: Mapping[str, Any], swhere: str,
                       path: str, *, what: str, readers: str, fix: str) -> list[Finding]:
  """Findings where ``path`` is not in a mounted Secret, or one everyone may read."""
  place = checks._volume_place(sidecar, posixpath.normpath(path)) if path else None
  volume = next((v for v in pod.get("volumes") or [] if place and v.get("name") == place[0]),
                None)
  secret = (volume or {}).get("secret")
  if secret is None:
    return [Finding(f"{swhere}.command", f"{what} {path!r} is not in a mounted Secret: {fix}")]
  modes = [secret.get("defaultMode", 0o644)] + [i["mode"] for i in secret.get("items") or []
                                                if "mode" in i]
  if any(int(m) & _OTHERS for m in modes):
    return [Finding(f"{swhere}: volume {place and place[0]}",
                    f"mode {max(modes):o} lets everyone read {readers}; set the Secret "
                    "volume's defaultMode to 0400")]
  return []


def _check_probes(sidecar: Mapping[str, Any], swhere: str) -> list[Finding]:
  health = int(checks._setting(sidecar, "--health-port", "SIDECAR_HEALTH_PORT",
                               options_lib.DEFAULT_HEALTH_PORT) or 0)
  findings = []
  for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
    port = ((sidecar.get(probe) or {}).get("grpc") or {}).get("port")
    if port != health:
      findings.append(Finding(f"{swhere}.{probe}",
                              f"must be a grpc probe of the health port {health}, got "
                              f"{sidecar.get(probe)!r}: the pool's jobs wait for readiness"))
  return findings


def _check_service(spec: Mapping[str, Any], template: Mapping[str, Any], where: str,
                   services: Mapping[str, Mapping[str, Any]], port: int) -> list[Finding]:
  name = str(spec.get("serviceName"))
  service = services.get(name)
  if service is None:
    return [Finding(f"{where}: spec.serviceName",
                    f"names Service {name!r}, which is not among the manifests; add a headless "
                    "Service (clusterIP: None) of that name selecting the pods")]
  sspec = service.get("spec") or {}
  findings = []
  if sspec.get("clusterIP") != "None":
    findings.append(Finding(f"Service {name}: spec.clusterIP",
                            "must be None (headless): each pod needs its own DNS name, "
                            "<pod>.<service>, for SIDECAR_HOSTS"))
  labels = (template.get("metadata") or {}).get("labels") or {}
  selector = sspec.get("selector") or {}
  if not selector or any(labels.get(k) != v for k, v in selector.items()):
    findings.append(Finding(f"Service {name}: spec.selector",
                            f"{selector} does not select the pods (labels {labels})"))
  if port not in {p.get("port") for p in sspec.get("ports") or []}:
    findings.append(Finding(f"Service {name}: spec.ports",
                            f"has no port {port} (the sidecars' gRPC, SIDECAR_PORT)"))
  return findings
