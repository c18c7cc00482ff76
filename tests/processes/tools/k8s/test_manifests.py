"""The kustomize manifests in k8s/: rendered with `kubectl kustomize`, validated offline."""

from __future__ import annotations

import os
import textwrap

import pytest

from sidecar._src.tools.k8s import checks
from tests.support import k8s_util as util

pytestmark = pytest.mark.processes


def write_kustomization(directory):
  """A kustomization of jobset.yaml with the sidecar component (kustomize wants it relative)."""
  component = os.path.relpath(util.K8S / "components" / "sidecar", directory)
  (directory / "kustomization.yaml").write_text(
      f"resources: [jobset.yaml]\ncomponents: [{component}]\n")


@pytest.mark.parametrize("overlay", util.OVERLAYS)
def test_overlay_renders_one_jobset_that_passes_every_check(rendered_overlays, overlay):
  docs = rendered_overlays[overlay]
  assert [(d["apiVersion"], d["kind"]) for d in docs] == [("jobset.x-k8s.io/v1alpha2", "JobSet")]
  findings = checks.check_documents(docs, crd_path=util.CRD)
  assert findings == []


@pytest.mark.parametrize("overlay", util.OVERLAYS)
def test_sidecar_is_a_native_sidecar_probed_on_its_health_port(rendered_overlays, overlay):
  (jobset,) = rendered_overlays[overlay]
  spec = util.pod_spec(jobset)
  (sidecar,) = spec["initContainers"]
  assert sidecar["restartPolicy"] == "Always"
  assert sidecar["command"] == ["sidecar", "serve"]
  env = util.env(jobset, "sidecar")
  health = int(env["SIDECAR_HEALTH_PORT"]["value"])
  metrics = int(env["SIDECAR_METRICS_PORT"]["value"])
  assert {p["containerPort"] for p in sidecar["ports"]} == {
      health, int(env["SIDECAR_PORT"]["value"]), metrics}
  for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
    assert sidecar[probe]["grpc"] == {"port": health}
  assert spec["terminationGracePeriodSeconds"] >= 60


@pytest.mark.parametrize("overlay", util.OVERLAYS)
def test_pods_carry_the_prometheus_scrape_annotations(rendered_overlays, overlay):
  (jobset,) = rendered_overlays[overlay]
  template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
  port = util.env(jobset, "sidecar")["SIDECAR_METRICS_PORT"]["value"]
  assert template["metadata"]["annotations"] == {
      "prometheus.io/scrape": "true", "prometheus.io/port": port, "prometheus.io/path": "/metrics"}


def field(env_entry):
  return env_entry["valueFrom"]["fieldRef"]["fieldPath"]


@pytest.mark.parametrize("overlay", util.OVERLAYS)
def test_identity_and_discovery_env_come_from_the_downward_api(rendered_overlays, overlay):
  (jobset,) = rendered_overlays[overlay]
  sidecar, trainer = util.env(jobset, "sidecar"), util.env(jobset, "trainer")
  assert field(sidecar["SIDECAR_SLICE_ID"]) == (
      "metadata.annotations['jobset.sigs.k8s.io/job-index']")
  assert field(sidecar["SIDECAR_HOST_ID"]) == (
      "metadata.annotations['batch.kubernetes.io/job-completion-index']")
  assert field(trainer["SIDECAR_NUM_SLICES"]) == (
      "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-replicas']")
  assert field(trainer["SIDECAR_JOBSET_NAME"]) == (
      "metadata.annotations['jobset.sigs.k8s.io/jobset-name']")
  completions = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"]
  assert trainer["SIDECAR_HOSTS_PER_SLICE"]["value"] == str(completions)
  assert trainer["SIDECAR_ADDRESS"]["value"] == "unix:///run/sidecar/sidecar.sock"
  assert sidecar["SIDECAR_TOKEN_FILE"]["value"] == trainer["SIDECAR_TOKEN_FILE"]["value"]
  token = next(v for v in util.pod_spec(jobset)["volumes"] if v["name"] == "sidecar-token")
  assert token["secret"]["secretName"] == "sidecar-token"
  # The peer token is the sidecars' alone: a trainer that had it could send replicas.
  assert sidecar["SIDECAR_PEER_TOKEN_FILE"]["value"] == "/var/run/secrets/sidecar-peer/token"
  assert "SIDECAR_PEER_TOKEN_FILE" not in trainer
  mounts = {c["name"]: {m["name"] for m in c["volumeMounts"]}
            for c in util.pod_spec(jobset)["initContainers"] + util.pod_spec(jobset)["containers"]}
  assert "sidecar-peer-token" in mounts["sidecar"] and "sidecar-peer-token" not in mounts["trainer"]


def test_gke_overlay_asks_for_tpu_slices(rendered_overlays):
  (jobset,) = rendered_overlays["gke-tpu-multislice"]
  rjob = jobset["spec"]["replicatedJobs"][0]
  job = rjob["template"]["spec"]
  assert (rjob["replicas"], job["parallelism"], job["completions"]) == (2, 4, 4)
  assert jobset["metadata"]["annotations"] == {
      "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  assert util.pod_spec(jobset)["nodeSelector"] == {
      "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
      "cloud.google.com/gke-tpu-topology": "4x4",
  }
  assert util.container(jobset, "trainer")["resources"]["limits"] == {"google.com/tpu": 4}
  assert util.container(jobset, "sidecar")["resources"]["limits"] == {"memory": "33792Mi"}
  assert util.env(jobset, "sidecar")["SIDECAR_SHM_SIZE"]["value"] == "32GiB"


def test_cpu_overlay_has_the_local_mode_shape_and_no_accelerator(rendered_overlays):
  (jobset,) = rendered_overlays["cpu"]
  rjob = jobset["spec"]["replicatedJobs"][0]
  assert (rjob["replicas"], rjob["template"]["spec"]["completions"]) == (1, 4)
  assert "nodeSelector" not in util.pod_spec(jobset)
  assert "google.com/tpu" not in str(jobset)
  assert util.env(jobset, "trainer")["XLA_FLAGS"]["value"] == (
      "--xla_force_host_platform_device_count=2")


def test_base_alone_has_no_sidecar_and_the_check_says_so(kustomize):
  findings = checks.check_documents(kustomize(util.K8S / "base"), crd_path=util.CRD)
  assert [f.message for f in findings] == [
      "no replicated job runs the sidecar: add an initContainers entry named 'sidecar' "
      "running `sidecar serve` (see k8s/components/sidecar)"]


def test_component_adds_the_sidecar_to_a_users_own_jobset(kustomize, tmp_path):
  (tmp_path / "jobset.yaml").write_text(textwrap.dedent("""\
      apiVersion: jobset.x-k8s.io/v1alpha2
      kind: JobSet
      metadata:
        name: mine
      spec:
        replicatedJobs:
        - name: slice
          replicas: 3
          template:
            spec:
              parallelism: 2
              completions: 2
              template:
                spec:
                  restartPolicy: Never
                  initContainers:
                  - name: fetch
                    image: busybox
                    command: [sh, -c, "echo fetched > /data/x"]
                    volumeMounts:
                    - {name: data, mountPath: /data}
                  containers:
                  - name: trainer
                    image: my/trainer
                    env:
                    - {name: MY_FLAG, value: "1"}
                    volumeMounts:
                    - {name: data, mountPath: /data}
                  volumes:
                  - name: data
                    emptyDir: {}
      """))
  write_kustomization(tmp_path)
  (jobset,) = kustomize(tmp_path)
  spec = util.pod_spec(jobset)
  assert jobset["spec"]["replicatedJobs"][0]["replicas"] == 3
  assert {c["name"] for c in spec["initContainers"]} == {"fetch", "sidecar"}
  assert {v["name"] for v in spec["volumes"]} == {"data", "sidecar-socket", "sidecar-tmp",
                                                   "sidecar-token", "sidecar-peer-token"}
  trainer_env = util.env(jobset, "trainer")
  assert trainer_env["MY_FLAG"]["value"] == "1"
  assert trainer_env["SIDECAR_HOSTS_PER_SLICE"]["value"] == "2"
  assert util.container(jobset, "trainer")["image"] == "my/trainer"
  assert checks.check_documents([jobset], crd_path=util.CRD) == []


def test_component_on_a_jobset_with_other_names_fails_the_checks(kustomize, tmp_path):
  (tmp_path / "jobset.yaml").write_text(textwrap.dedent("""\
      apiVersion: jobset.x-k8s.io/v1alpha2
      kind: JobSet
      metadata:
        name: mine
      spec:
        replicatedJobs:
        - name: workers
          replicas: 1
          template:
            spec:
              completions: 2
              parallelism: 2
              template:
                spec:
                  restartPolicy: Never
                  containers:
                  - name: main
                    image: my/trainer
      """))
  write_kustomization(tmp_path)
  # The component expects the replicated job `slice`; kustomize refuses, naming it.
  with pytest.raises(AssertionError, match=r"spec\.replicatedJobs\.\[name=slice\]\.template"
                                           r"\.spec\.completions` is missing"):
    kustomize(tmp_path)


def test_the_tls_component_mounts_the_certificates_for_both_sides(kustomize, tmp_path):
  (tmp_path / "kustomization.yaml").write_text(
      f"resources: [{os.path.relpath(util.K8S / 'base', tmp_path)}]\ncomponents:\n"
      + "".join(f"- {os.path.relpath(util.K8S / 'components' / c, tmp_path)}\n"
                for c in ("sidecar", "sidecar-tls")))
  (jobset,) = kustomize(tmp_path)
  spec = util.pod_spec(jobset)
  secrets = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
  assert secrets["sidecar-tls"]["secretName"] == "sidecar-tls"
  assert secrets["sidecar-tls-client"]["secretName"] == "sidecar-tls-client"
  assert {s["defaultMode"] for s in secrets.values()} == {0o400}
  sidecar, trainer = util.env(jobset, "sidecar"), util.env(jobset, "trainer")
  where = "/var/run/secrets/sidecar-tls/"
  assert {k: sidecar[k]["value"] for k in ("SIDECAR_TLS_CERT", "SIDECAR_TLS_KEY",
                                           "SIDECAR_TLS_CLIENT_CA")} == {
      "SIDECAR_TLS_CERT": where + "tls.crt", "SIDECAR_TLS_KEY": where + "tls.key",
      "SIDECAR_TLS_CLIENT_CA": where + "ca.crt"}
  client = "/var/run/secrets/sidecar-tls-client/"
  assert trainer["SIDECAR_TLS_CA"]["value"] == client + "ca.crt"
  assert trainer["SIDECAR_TLS_CLIENT_CERT"]["value"] == client + "tls.crt"
  assert "SIDECAR_TOKEN_FILE" in sidecar and "SIDECAR_PORT" in trainer  # merged, not replaced
  mounts = {name: {m["name"]: m for m in util.container(jobset, name)["volumeMounts"]}
            for name in ("sidecar", "trainer")}
  assert mounts["sidecar"]["sidecar-tls"]["readOnly"]
  assert mounts["trainer"]["sidecar-tls-client"]["readOnly"]
  # The sidecar's private key (and the peer token) never enter the trainer.
  assert "sidecar-tls" not in mounts["trainer"] and "sidecar-peer-token" not in mounts["trainer"]
  assert all("sidecar-tls/" not in e.get("value", "") for e in trainer.values())
  assert checks.check_documents([jobset], crd_path=util.CRD) == []


@pytest.mark.parametrize("overlay", util.OVERLAYS)
def test_the_pods_are_hardened(rendered_overlays, overlay):
  (jobset,) = rendered_overlays[overlay]
  spec = util.pod_spec(jobset)
  assert spec["automountServiceAccountToken"] is False
  assert spec["securityContext"]["fsGroup"] == 1000  # the 0660 socket's group, both sides'
  sidecar, trainer = (util.container(jobset, n)["securityContext"] for n in ("sidecar", "trainer"))
  for context in (sidecar, trainer):
    assert context["runAsNonRoot"] and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
  assert sidecar["readOnlyRootFilesystem"] is True
  assert {v["name"]: v["secret"]["defaultMode"] for v in spec["volumes"] if "secret" in v} == {
      "sidecar-token": 0o400, "sidecar-peer-token": 0o400}


def test_the_network_policy_admits_only_the_jobsets_pods_and_the_scraper(kustomize, tmp_path):
  import kubernetes_validate

  from sidecar._src.tools.k8s import schemas
  (tmp_path / "kustomization.yaml").write_text(
      f"resources: [{os.path.relpath(util.K8S / 'base', tmp_path)}]\ncomponents:\n"
      + "".join(f"- {os.path.relpath(util.K8S / 'components' / c, tmp_path)}\n"
                for c in ("sidecar", "sidecar-network-policy")))
  docs = kustomize(tmp_path)
  (jobset,) = [d for d in docs if d["kind"] == "JobSet"]
  (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
  for version in schemas.default_versions():
    kubernetes_validate.validate(policy, version, strict=True)
  assert policy["metadata"]["name"] == "train-sidecar"
  pods = {"jobset.sigs.k8s.io/jobset-name": "train"}  # the label JobSet gives its pods
  assert policy["spec"]["podSelector"] == {"matchLabels": pods}
  assert policy["spec"]["policyTypes"] == ["Ingress"]
  own, scraper = policy["spec"]["ingress"]
  assert own == {"from": [{"podSelector": {"matchLabels": pods}}]}
  assert scraper["ports"] == [{"port": 8492, "protocol": "TCP"}]  # /metrics, nothing else
  ports = {p["containerPort"] for c in util.pod_spec(jobset)["initContainers"]
           for p in c.get("ports", [])}
  assert ports == {8490, 8491, 8492}
  assert checks.check_documents(docs, crd_path=util.CRD) == []
