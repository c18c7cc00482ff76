"""The shared pool's manifests (k8s/pool, issue 37): rendered with `kubectl kustomize`,
validated offline (strict schemas at 1.29 and the newest), and a tenant's job finds the
pool's sidecars as Controller.from_env() would."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from sidecar._src.controller import discovery
from sidecar._src.tools.k8s import pool, schemas
from tests.support import k8s_util as util

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def rendered(kustomize):
  return kustomize(util.K8S / "pool"), kustomize(util.K8S / "pool" / "example")


def test_the_pool_renders_a_headless_service_and_a_statefulset_that_pass_every_check(rendered):
  docs, _ = rendered
  assert [(d["apiVersion"], d["kind"]) for d in docs] == [("v1", "Service"),
                                                           ("apps/v1", "StatefulSet")]
  assert pool.check_pool(docs) == []  # with the strict schemas


def test_the_pools_replica_hosts_are_its_own_pods_by_ordinal(rendered):
  """Its sidecars send a tenant's replicas only to the set's pods (issue 42): the check
  names a list that is not them, in order."""
  docs, _ = rendered
  bad = copy.deepcopy(docs)
  (statefulset,) = pool.pool_sets(bad)
  statefulset["spec"]["replicas"] = 3
  (finding,) = pool.check_pool(bad)
  assert "env[SIDECAR_REPLICA_HOSTS]" in finding.where
  assert "sidecar-pool-2.sidecar-pool:8490" in finding.message


def test_sidecar_k8s_check_takes_the_pool_and_names_a_readable_pool_file(rendered, kubectl):
  render = subprocess.run([kubectl, "kustomize", str(util.K8S / "pool")], capture_output=True,
                          text=True, check=True, timeout=60).stdout
  check = [sys.executable, "-m", "sidecar", "k8s", "check", "-"]
  ok = subprocess.run(check, input=render, capture_output=True, text=True, timeout=120)
  assert ok.returncode == 0, ok.stdout + ok.stderr
  assert "0 problem(s) in 1 file(s)" in ok.stderr
  bad = subprocess.run(check + ["--no-pod-schema"], input=render.replace(
      "defaultMode: 256", "defaultMode: 292"), capture_output=True, text=True, timeout=120)
  assert bad.returncode == 1
  assert "mode 444 lets everyone read the pool file" in bad.stdout


def test_a_tenants_job_finds_every_sidecar_of_the_pool_in_host_id_order(rendered):
  docs, (job,) = rendered
  assert schemas.validate_object(job) == []
  (statefulset,) = pool.pool_sets(docs)
  service = statefulset["spec"]["serviceName"]
  (trainer,) = job["spec"]["template"]["spec"]["containers"]
  env = {e["name"]: e.get("value") for e in trainer["env"]}
  endpoints = discovery.endpoints_from_env(env)
  replicas = statefulset["spec"]["replicas"]
  assert [e.address for e in endpoints] == [
      f"{statefulset['metadata']['name']}-{i}.{service}:8490" for i in range(replicas)]
  assert [e.health_address for e in endpoints] == [
      f"{statefulset['metadata']['name']}-{i}.{service}:8491" for i in range(replicas)]
  token = next(v for v in job["spec"]["template"]["spec"]["volumes"]
               if v["name"] == "sidecar-token")
  assert token["secret"]["defaultMode"] == 0o400


def test_the_pool_has_an_operator_token_kept_as_the_tenants_tokens(rendered):
  """Issue 42's gap (e): the pool's sidecars were given no operator token, so nobody could
  read every tenant's Status row. The StatefulSet passes one from a Secret of its own
  (0400); the check names one outside a Secret, or one everyone may read."""
  docs, _ = rendered
  (statefulset,) = pool.pool_sets(docs)
  spec = statefulset["spec"]["template"]["spec"]
  (sidecar,) = spec["containers"]
  command = sidecar["command"]
  path = command[command.index("--operator-token-file") + 1]
  (mount,) = [m for m in sidecar["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
  (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
  assert volume["secret"] == {"secretName": "sidecar-operator-token", "defaultMode": 0o400}
  for change, found in (({"emptyDir": {}}, "the pool's operator token "
                         "'/var/run/secrets/sidecar-operator/token' is not in a mounted Secret"),
                        ({"secret": {"secretName": "x", "defaultMode": 0o444}},
                         "mode 444 lets everyone read the operator token")):
    bad = copy.deepcopy(docs)
    (bad_set,) = pool.pool_sets(bad)
    bad_volumes = bad_set["spec"]["template"]["spec"]["volumes"]
    (v,) = [v for v in bad_volumes if v["name"] == mount["name"]]
    v.pop("secret")
    v.update(change)
    (finding,) = pool.check_pool(bad, kubernetes_versions=[])
    assert found in finding.message, finding
