"""Tier 1: the checks of a shared pool's manifests (k8s/pool, issue 37), on the files as
they are and with each mistake made in turn."""

import copy
import re

import pytest
import yaml

from sidecar._src.tools.k8s import pool
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

POOL = ROOT / "k8s" / "pool"


@pytest.fixture
def docs():
  return [yaml.safe_load((POOL / f).read_text()) for f in ("service.yaml", "statefulset.yaml")]


def sidecar(docs):
  return docs[1]["spec"]["template"]["spec"]["containers"][0]


def volume(docs, name):
  return next(v for v in docs[1]["spec"]["template"]["spec"]["volumes"] if v["name"] == name)


def test_the_pool_as_shipped_has_no_finding(docs):
  assert [d["kind"] for d in pool.pool_sets(docs)] == ["StatefulSet"]
  assert pool.check_pool(docs, kubernetes_versions=()) == []


def readable(docs):
  volume(docs, "sidecar-pool")["secret"]["defaultMode"] = 0o444


def not_headless(docs):
  docs[0]["spec"]["clusterIP"] = "10.0.0.1"


def other_selector(docs):
  docs[0]["spec"]["selector"] = {"app.kubernetes.io/name": "other"}


def no_service(docs):
  del docs[0]


def host_id_literal(docs):
  env = sidecar(docs)["env"]
  env[0] = {"name": "SIDECAR_HOST_ID", "value": "0"}


def pool_file_elsewhere(docs):
  sidecar(docs)["command"] = ["sidecar", "serve", "--pool", "/tmp/pool.yaml"]


def small_memory(docs):
  sidecar(docs)["resources"]["limits"]["memory"] = "8Gi"


def probe_elsewhere(docs):
  sidecar(docs)["livenessProbe"] = {"grpc": {"port": 8490}}


MISTAKES = [
    (readable, r"mode 444 lets everyone read the pool file and the tenants' tokens; set the "
               r"Secret volume's defaultMode to 0400"),
    (not_headless, r"must be None \(headless\)"),
    (other_selector, r"does not select the pods"),
    (no_service, r"names Service 'sidecar-pool', which is not among the manifests"),
    (host_id_literal, r"must come from the pod's ordinal \(metadata.labels\['apps.kubernetes"),
    (pool_file_elsewhere, r"the pool file '/tmp/pool.yaml' is not in a mounted Secret"),
    (small_memory, r"is 8Gi but the arena \(8GiB\) plus 1Gi needs"),
    (probe_elsewhere, r"livenessProbe: must be a grpc probe of the health port 8491"),
]


@pytest.mark.parametrize("mistake, message", MISTAKES, ids=[m.__name__ for m, _ in MISTAKES])
def test_each_mistake_is_one_finding_naming_it(docs, mistake, message):
  broken = copy.deepcopy(docs)
  mistake(broken)
  (finding,) = pool.check_pool(broken, kubernetes_versions=())
  assert re.search(message, str(finding)), str(finding)
