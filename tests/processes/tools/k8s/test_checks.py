"""The offline checks: one planted error of each kind, and the check that catches it."""

from __future__ import annotations

import re

import pytest

from sidecar._src.core import errors
from sidecar._src.tools.k8s import checks
from tests.support import k8s_util as util

pytestmark = pytest.mark.processes


def _spec(j):
  return util.pod_spec(j)


def _rjob(j):
  return j["spec"]["replicatedJobs"][0]


def _set_env(j, container, name, value):
  entry = util.env(j, container)[name]
  entry.clear()
  entry.update(name=name, value=value)


def _drop_env(j, container, name):
  util.container(j, container)["env"].remove(util.env(j, container)[name])


def _move_sidecar_to_containers(j):
  _spec(j)["containers"].append(_spec(j).pop("initContainers")[0])


def _trainer_mounts_another_volume(j):
  _spec(j)["volumes"].append({"name": "other", "emptyDir": {"medium": "Memory",
                                                            "sizeLimit": "1Mi"}})
  util.container(j, "trainer")["volumeMounts"][0]["name"] = "other"


def _coordinator_on_the_sidecar_port(j):
  _set_env(j, "trainer", "SIDECAR_COORDINATOR_PORT", "8490")
  util.container(j, "trainer")["ports"][0]["containerPort"] = 8490


def _list_hosts_without_dns(j):
  j["spec"]["network"]["enableDNSHostnames"] = False
  util.container(j, "trainer")["env"].append({"name": "SIDECAR_HOSTS", "value": "a,b,c,d"})


# (id, mutation, pattern that a finding must match)
PLANTED = [
    ("jobset-unknown-field",
     lambda j: _rjob(j).update(replica=2),
     r"spec\.replicatedJobs\[0\]: JobSet schema: Additional properties are not allowed "
     r"\('replica' was unexpected\)"),
    ("jobset-wrong-api-version",
     lambda j: j.update(apiVersion="jobset.x-k8s.io/v1alpha1"),
     r"apiVersion is 'jobset\.x-k8s\.io/v1alpha1'; this schema is for jobset\.x-k8s\.io/v1alpha2"),
    ("pod-unknown-field",
     lambda j: util.container(j, "trainer").update(imagePullPolicyy="Always"),
     r"containers\[0\]: Pod schema \(Kubernetes 1\.29, strict\): Additional properties are not "
     r"allowed \('imagePullPolicyy' was unexpected\)"),
    ("volume-mount-without-volume",
     lambda j: util.container(j, "trainer")["volumeMounts"][0].update(name="sidecar-sockett"),
     r"containers\[0\]\.volumeMounts\[0\]: mounts volume 'sidecar-sockett', which the pod does "
     r"not define; add it to spec\.volumes"),
    ("probe-port-not-a-container-port",
     lambda j: util.container(j, "sidecar")["ports"].pop(1),
     r"initContainers\[0\]\.startupProbe\.grpc\.port: port 8491 is not a containerPort of "
     r"'sidecar' \(has \[8490, 8492\]\)"),
    ("metrics-port-not-declared",
     lambda j: util.container(j, "sidecar")["ports"].pop(2),
     r"initContainers\[0\]\.ports: the sidecar serves metrics on 8492 \(SIDECAR_METRICS_PORT / "
     r"--metrics-port\) but does not declare it"),
    ("scrape-annotation-on-another-port",
     lambda j: j["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"][
         "annotations"].update({"prometheus.io/port": "9090"}),
     r"template\.metadata\.annotations\['prometheus\.io/port'\]: is '9090' but the sidecar "
     r"serves metrics on 8492"),
    ("probe-port-by-name",
     lambda j: util.container(j, "sidecar")["livenessProbe"]["grpc"].update(port="health"),
     r"livenessProbe\.grpc\.port: port 'health' is not a containerPort of 'sidecar'"),
    ("probe-not-on-health-port",
     lambda j: util.container(j, "sidecar")["readinessProbe"]["grpc"].update(port=8490),
     r"readinessProbe\.grpc\.port: probes port 8490 but the sidecar serves health on 8491"),
    ("sidecar-without-probe",
     lambda j: util.container(j, "sidecar").pop("livenessProbe"),
     r"initContainers\[0\]\.livenessProbe: the sidecar needs a gRPC livenessProbe on its health "
     r"port 8491"),
    ("memory-emptydir-without-size-limit",
     lambda j: _spec(j)["volumes"][0]["emptyDir"].pop("sizeLimit"),
     r"volumes\[0\]: memory emptyDir 'sidecar-socket' has no sizeLimit"),
    ("sidecar-without-restart-policy",
     lambda j: util.container(j, "sidecar").pop("restartPolicy"),
     r"initContainers\[0\]: the sidecar must be a native sidecar: an initContainers entry with "
     r"restartPolicy: Always"),
    ("sidecar-as-a-regular-container",
     _move_sidecar_to_containers,
     r"containers\[1\]: the sidecar must be a native sidecar"),
    ("no-sidecar-at-all",
     lambda j: _spec(j).pop("initContainers"),
     r"containers\[0\]: sets SIDECAR_ADDRESS but the pod has no sidecar"),
    ("socket-path-differs",
     lambda j: _set_env(j, "trainer", "SIDECAR_ADDRESS", "unix:///run/sidecar/other.sock"),
     r"env\[SIDECAR_ADDRESS\]: 'unix:///run/sidecar/other\.sock' is not the sidecar's socket "
     r"/run/sidecar/sidecar\.sock on volume 'sidecar-socket'"),
    ("socket-on-another-volume",
     _trainer_mounts_another_volume,
     r"'unix:///run/sidecar/sidecar\.sock' is not the sidecar's socket .* mount that volume in "
     r"'trainer'"),
    ("socket-not-on-a-volume",
     lambda j: _set_env(j, "sidecar", "SIDECAR_SOCKET", "/var/sidecar.sock"),
     r"initContainers\[0\]: socket /var/sidecar\.sock is not on a mounted volume"),
    ("address-not-a-unix-socket",
     lambda j: _set_env(j, "trainer", "SIDECAR_ADDRESS", "localhost:8490"),
     r"env\[SIDECAR_ADDRESS\]: is 'localhost:8490'; the worker attaches over the Unix socket"),
    ("no-trainer-address",
     lambda j: _drop_env(j, "trainer", "SIDECAR_ADDRESS"),
     r"no container sets SIDECAR_ADDRESS; give the trainer "
     r"SIDECAR_ADDRESS=unix:///run/sidecar/sidecar\.sock"),
    ("arena-above-memory-limit",
     lambda j: _set_env(j, "sidecar", "SIDECAR_SHM_SIZE", "1GiB"),
     r"resources\.limits\.memory: is 1280Mi but the arena \(1GiB\) plus 1Gi needs 2048Mi"),
    ("no-memory-limit",
     lambda j: util.container(j, "sidecar")["resources"].pop("limits"),
     r"the sidecar has no memory limit; the arena is charged to it"),
    ("short-grace-period",
     lambda j: _spec(j).update(terminationGracePeriodSeconds=10),
     r"terminationGracePeriodSeconds: is 10; give the sidecar at least 60s"),
    ("hosts-per-slice-stale",
     lambda j: _rjob(j)["template"]["spec"].update(completions=8, parallelism=8),
     r"spec\.replicatedJobs\[0\]\.template\.spec\.template\.spec\.containers\[0\]\.env"
     r"\[SIDECAR_HOSTS_PER_SLICE\]: is '4' but the JobSet or sidecar says '8'; "
     r"set SIDECAR_HOSTS_PER_SLICE=8"),
    ("trainer-port-differs",
     lambda j: _set_env(j, "trainer", "SIDECAR_PORT", "8470"),
     r"env\[SIDECAR_PORT\]: is '8470' but the JobSet or sidecar says '8490'; "
     r"set SIDECAR_PORT=8490"),
    ("subdomain-without-env",
     lambda j: j["spec"]["network"].update(subdomain="net"),
     r"env\[SIDECAR_SUBDOMAIN\]: is unset \(so 'train'\) but the JobSet or sidecar says 'net'; "
     r"set SIDECAR_SUBDOMAIN=net"),
    ("subdomain-env-without-jobset-subdomain",
     lambda j: util.container(j, "trainer")["env"].append(
         {"name": "SIDECAR_SUBDOMAIN", "value": "net"}),
     r"env\[SIDECAR_SUBDOMAIN\]: is 'net' but the JobSet or sidecar says 'train'"),
    ("trainer-health-port-differs",
     lambda j: _set_env(j, "trainer", "SIDECAR_HEALTH_PORT", "9999"),
     r"env\[SIDECAR_HEALTH_PORT\]: is '9999' but the JobSet or sidecar says '8491'"),
    ("dns-hostnames-off",
     lambda j: j["spec"]["network"].update(enableDNSHostnames=False),
     r"spec\.network\.enableDNSHostnames: is false; discovery reaches sidecars by their JobSet "
     r"hostnames"),
    ("parallelism-below-completions",
     lambda j: _rjob(j)["template"]["spec"].update(parallelism=2),
     r"parallelism: is 2 but completions is 4; every host of a slice runs at once"),
    ("discovery-env-missing",
     lambda j: _drop_env(j, "trainer", "SIDECAR_JOBSET_NAME"),
     r"SIDECAR_JOBSET_NAME is not set; discovery and sidecar\.jax\.initialize\(\) need "
     r"it"),
    # sidecar.jax.initialize(): process ids and the coordinator.
    ("trainer-without-slice-id",
     lambda j: _drop_env(j, "trainer", "SIDECAR_SLICE_ID"),
     r"containers\[0\]\.env: SIDECAR_SLICE_ID is not set; sidecar\.jax\.initialize\(\) "
     r"needs it"),
    ("slice-id-literal",
     lambda j: _set_env(j, "trainer", "SIDECAR_SLICE_ID", "0"),
     r"env\[SIDECAR_SLICE_ID\]: is '0'; sidecar\.jax\.initialize\(\) derives the process "
     r"id from it, so take it from the downward API: fieldPath "
     r"metadata\.annotations\['jobset\.sigs\.k8s\.io/job-index'\]"),
    ("host-id-from-the-job-index",
     lambda j: util.env(j, "trainer")["SIDECAR_HOST_ID"]["valueFrom"]["fieldRef"].update(
         fieldPath="metadata.annotations['jobset.sigs.k8s.io/job-index']"),
     r"env\[SIDECAR_HOST_ID\]: is from "
     r"\"metadata\.annotations\['jobset\.sigs\.k8s\.io/job-index'\]\""
     r"; .* fieldPath metadata\.annotations\['batch\.kubernetes\.io/job-completion-index'\]"),
    ("process-id-literal",
     lambda j: util.container(j, "trainer")["env"].append(
         {"name": "SIDECAR_PROCESS_ID", "value": "0"}),
     r"env\[SIDECAR_PROCESS_ID\]: is '0' in every pod; drop it"),
    ("num-processes-wrong",
     lambda j: util.container(j, "trainer")["env"].append(
         {"name": "SIDECAR_NUM_PROCESSES", "value": "8"}),
     r"env\[SIDECAR_NUM_PROCESSES\]: is '8' but the JobSet runs 4 pods \(replicas 1 x "
     r"completions 4\); set it to 4 or drop it"),
    ("coordinator-port-not-declared",
     lambda j: util.container(j, "trainer").pop("ports"),
     r"containers\[0\]\.ports: do not declare the coordinator port 8476 "
     r"\(SIDECAR_COORDINATOR_PORT\).*add \{name: coordinator, containerPort: 8476\}"),
    ("coordinator-port-env-not-declared",
     lambda j: _set_env(j, "trainer", "SIDECAR_COORDINATOR_PORT", "9000"),
     r"ports: do not declare the coordinator port 9000"),
    ("coordinator-port-is-the-sidecars",
     _coordinator_on_the_sidecar_port,
     r"env\[SIDECAR_COORDINATOR_PORT\]: is 8490, which the sidecar in the same pod serves on"),
    ("hosts-listed-dns-off-coordinator-derived",
     _list_hosts_without_dns,
     r"spec\.network\.enableDNSHostnames: is false; sidecar\.jax\.initialize\(\) reaches "
     r"the coordinator at the JobSet hostname of slice 0 host 0"),
    ("hosts-listed-hosts-per-slice-stale",
     lambda j: (_list_hosts_without_dns(j),
                _rjob(j)["template"]["spec"].update(completions=8, parallelism=8)),
     r"env\[SIDECAR_HOSTS_PER_SLICE\]: is '4' but the JobSet or sidecar says '8'"),
]


def test_the_unplanted_jobset_is_clean(cpu_jobset):
  assert checks.check_documents([cpu_jobset], crd_path=util.CRD) == []


@pytest.mark.parametrize("plant, pattern", [(p, m) for _, p, m in PLANTED],
                         ids=[i for i, _, _ in PLANTED])
def test_each_planted_error_is_caught(cpu_jobset, plant, pattern):
  plant(cpu_jobset)
  findings = [str(f) for f in checks.check_documents([cpu_jobset], crd_path=util.CRD)]
  assert any(re.search(pattern, f) for f in findings), "\n".join(findings) or "no findings"


def test_a_field_newer_than_1_29_fails_only_at_1_29(cpu_jobset):
  # Pod-level resources arrived in Kubernetes 1.32: valid at the newest version, not at 1.29.
  util.pod_spec(cpu_jobset)["resources"] = {"limits": {"cpu": "4"}}
  findings = checks.check_documents([cpu_jobset], crd_path=util.CRD)
  assert [f.message for f in findings] == [
      "Pod schema (Kubernetes 1.29, strict): Additional properties are not allowed "
      "('resources' was unexpected)"]


def test_sidecar_settings_from_flags_override_env(cpu_jobset):
  sidecar = util.container(cpu_jobset, "sidecar")
  sidecar["command"] = ["sidecar", "serve", "--health-port", "9000"]
  findings = [str(f) for f in checks.check_documents([cpu_jobset], kubernetes_versions=())]
  assert any("probes port 8491 but the sidecar serves health on 9000" in f for f in findings)


def test_trainer_that_lists_hosts_and_coordinator_needs_no_dns_hostnames(cpu_jobset):
  _list_hosts_without_dns(cpu_jobset)
  util.container(cpu_jobset, "trainer")["env"].append(
      {"name": "SIDECAR_COORDINATOR_ADDRESS", "value": "a:8476"})
  assert checks.check_documents([cpu_jobset], kubernetes_versions=()) == []


def test_trainer_with_the_whole_contract_explicit_needs_no_jobset_env(cpu_jobset):
  trainer = util.container(cpu_jobset, "trainer")
  for name in ("SIDECAR_JOBSET_NAME", "SIDECAR_REPLICATED_JOB", "SIDECAR_NUM_SLICES",
               "SIDECAR_HOSTS_PER_SLICE", "SIDECAR_SLICE_ID", "SIDECAR_HOST_ID",
               "SIDECAR_COORDINATOR_PORT"):
    _drop_env(cpu_jobset, "trainer", name)
  trainer.pop("ports")
  trainer["env"] += [
      {"name": "SIDECAR_HOSTS", "value": "a,b,c,d"},
      {"name": "SIDECAR_COORDINATOR_ADDRESS", "value": "a:8476"},
      {"name": "SIDECAR_NUM_PROCESSES", "value": "4"},
      {"name": "SIDECAR_PROCESS_ID", "valueFrom": {"fieldRef": {
          "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
  ]
  assert checks.check_documents([cpu_jobset], kubernetes_versions=()) == []


def test_raise_for_findings_lists_every_finding(cpu_jobset):
  _spec(cpu_jobset)["volumes"][0]["emptyDir"].pop("sizeLimit")
  util.container(cpu_jobset, "sidecar").pop("restartPolicy")
  findings = checks.check_documents([cpu_jobset], kubernetes_versions=())
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"(?s)2 problem\(s\) in the manifests:.*no sizeLimit.*native sidecar"):
    checks.raise_for_findings(findings)
  checks.raise_for_findings([])


def test_mounts_of_volume_claim_policies_count_as_volumes(cpu_jobset):
  util.container(cpu_jobset, "trainer")["volumeMounts"].append(
      {"name": "scratch", "mountPath": "/scratch"})
  found = [str(f) for f in checks.check_documents([cpu_jobset], crd_path=util.CRD)]
  assert any("mounts volume 'scratch', which the pod does not define" in f for f in found)
  cpu_jobset["spec"]["volumeClaimPolicies"] = [{"templates": [{
      "metadata": {"name": "scratch"},
      "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
  }]}]
  assert checks.check_documents([cpu_jobset], crd_path=util.CRD) == []
