"""Every trainer the manifests render can start jax.distributed from its env alone.

For each pod of each JobSet (every overlay, and `sidecar k8s render` output) the test builds
the metadata JobSet and the Indexed Job give that pod, resolves the trainer's env through the
downward API as the kubelet would, and applies the contract of
``sidecar.jax.initialize()`` to it. The contract is written out here, not imported, so
that these manifests are pinned to it on their own:

- ``SIDECAR_COORDINATOR_ADDRESS``, else
  ``{SIDECAR_JOBSET_NAME}-{SIDECAR_REPLICATED_JOB}-0-0.{SIDECAR_SUBDOMAIN}:{SIDECAR_COORDINATOR_PORT}``
  with the subdomain defaulting to the JobSet name and the port to 8476;
- ``SIDECAR_NUM_PROCESSES``, else ``SIDECAR_NUM_SLICES * SIDECAR_HOSTS_PER_SLICE``;
- ``SIDECAR_PROCESS_ID``, else ``SIDECAR_SLICE_ID * SIDECAR_HOSTS_PER_SLICE + SIDECAR_HOST_ID``.
"""

from __future__ import annotations

import re

import pytest

from sidecar._src.tools.k8s import render
from tests.support import k8s_util as util

pytestmark = pytest.mark.processes

DEFAULT_COORDINATOR_PORT = 8476

RENDERED = {
    "render-minimal": dict(slices=1, hosts_per_slice=1, image="sidecar:1"),
    "render-cpu-shape": dict(slices=3, hosts_per_slice=4, image="sidecar:1"),
    "render-v6e-namespace": dict(slices=4, hosts_per_slice=16, image="sidecar:1",
                                 tpu=render.parse_tpu("v6e:8x8"), namespace="ml",
                                 name="big-run"),
    "render-v5p-ports": dict(slices=2, hosts_per_slice=8, image="sidecar:1",
                             tpu=render.parse_tpu("v5p:2x4x4"), port=9000, health_port=9001,
                             coordinator_port=9002),
}
CASES = [f"overlay-{name}" for name in util.OVERLAYS] + list(RENDERED)


@pytest.fixture(params=CASES)
def jobset(request, rendered_overlays) -> dict:
  if request.param.startswith("overlay-"):
    (doc,) = rendered_overlays[request.param.removeprefix("overlay-")]
    return doc
  return render.render_jobset(render.RenderOptions(**RENDERED[request.param]))


def pod_metadata(jobset: dict, rjob: dict, slice_id: int, host_id: int) -> dict:
  """What JobSet and the Indexed Job put on the pod (slice_id, host_id)."""
  name = jobset["metadata"]["name"]
  return {
      "namespace": jobset["metadata"].get("namespace", "default"),
      "annotations": {
          "jobset.sigs.k8s.io/jobset-name": name,
          "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
          "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob.get("replicas", 1)),
          "jobset.sigs.k8s.io/job-index": str(slice_id),
          "batch.kubernetes.io/job-completion-index": str(host_id),
      },
  }


def pod_fqdn(jobset: dict, rjob: dict, slice_id: int, host_id: int) -> str:
  """The hostname.subdomain JobSet gives a pod when network.enableDNSHostnames is true."""
  assert jobset["spec"]["network"]["enableDNSHostnames"] is True
  name = jobset["metadata"]["name"]
  subdomain = jobset["spec"]["network"].get("subdomain") or name
  return f"{name}-{rjob['name']}-{slice_id}-{host_id}.{subdomain}"


def resolve_env(container: dict, metadata: dict) -> dict[str, str]:
  """The container's env as the kubelet sets it: literals, and downward-API fieldRefs."""
  env = {}
  for entry in container.get("env", []):
    if "valueFrom" not in entry:
      env[entry["name"]] = str(entry["value"])
      continue
    path = entry["valueFrom"]["fieldRef"]["fieldPath"]
    annotation = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path)
    if annotation:
      env[entry["name"]] = metadata["annotations"][annotation.group(1)]
    elif path == "metadata.namespace":
      env[entry["name"]] = metadata["namespace"]
    else:
      raise AssertionError(f"{entry['name']}: fieldPath {path!r} is not one this test models")
  return env


def contract(env: dict[str, str]) -> tuple[str, int, int]:
  """(coordinator address, num processes, process id), as initialize() resolves them."""
  if "SIDECAR_COORDINATOR_ADDRESS" in env:
    coordinator = env["SIDECAR_COORDINATOR_ADDRESS"]
  else:
    jobset = env["SIDECAR_JOBSET_NAME"]
    subdomain = env.get("SIDECAR_SUBDOMAIN", jobset)
    port = env.get("SIDECAR_COORDINATOR_PORT", str(DEFAULT_COORDINATOR_PORT))
    coordinator = f"{jobset}-{env['SIDECAR_REPLICATED_JOB']}-0-0.{subdomain}:{port}"
  hosts_per_slice = int(env["SIDECAR_HOSTS_PER_SLICE"])
  if "SIDECAR_NUM_PROCESSES" in env:
    num_processes = int(env["SIDECAR_NUM_PROCESSES"])
  else:
    num_processes = int(env["SIDECAR_NUM_SLICES"]) * hosts_per_slice
  if "SIDECAR_PROCESS_ID" in env:
    process_id = int(env["SIDECAR_PROCESS_ID"])
  else:
    process_id = int(env["SIDECAR_SLICE_ID"]) * hosts_per_slice + int(env["SIDECAR_HOST_ID"])
  return coordinator, num_processes, process_id


def test_every_pod_resolves_its_own_process_and_the_same_coordinator(jobset):
  (rjob,) = jobset["spec"]["replicatedJobs"]
  replicas, completions = rjob["replicas"], rjob["template"]["spec"]["completions"]
  trainer = util.container(jobset, "trainer")
  resolved = {}
  for slice_id in range(replicas):
    for host_id in range(completions):
      env = resolve_env(trainer, pod_metadata(jobset, rjob, slice_id, host_id))
      resolved[slice_id, host_id] = contract(env)
  process_ids = sorted(process_id for _, _, process_id in resolved.values())
  assert process_ids == list(range(replicas * completions))
  assert {n for _, n, _ in resolved.values()} == {replicas * completions}
  # Slice-major order, as discovery lists the sidecars: process i drives host i.
  assert [resolved[s, h][2] for s in range(replicas) for h in range(completions)] == process_ids
  (coordinator,) = {address for address, _, _ in resolved.values()}
  host, _, port = coordinator.rpartition(":")
  assert host == pod_fqdn(jobset, rjob, 0, 0)
  declared = {p["containerPort"]: p["name"] for p in trainer["ports"]}
  assert declared.get(int(port)) == "coordinator"
  sidecar = util.container(jobset, "sidecar")
  assert int(port) not in {p["containerPort"] for p in sidecar["ports"]}


def test_every_pod_is_a_torch_rank_whose_master_is_process_0s_pod(jobset):
  # The same manifests serve a PyTorch trainer, one rank per pod: sidecar.torch.connect()
  # takes torchrun's variables from the pod's SIDECAR_* job (torch/distributed.launcher_env).
  from sidecar._src.torch.distributed import launcher_env
  (rjob,) = jobset["spec"]["replicatedJobs"]
  replicas, completions = rjob["replicas"], rjob["template"]["spec"]["completions"]
  trainer = util.container(jobset, "trainer")
  ranks = [launcher_env(resolve_env(trainer, pod_metadata(jobset, rjob, s, h)))
           for s in range(replicas) for h in range(completions)]
  assert [int(r["RANK"]) for r in ranks] == list(range(replicas * completions))
  assert {r["WORLD_SIZE"] for r in ranks} == {str(replicas * completions)}
  (master,) = {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}
  assert master[0] == pod_fqdn(jobset, rjob, 0, 0)
  assert {p["containerPort"]: p["name"] for p in trainer["ports"]}[int(master[1])] == (
      "coordinator")


@pytest.mark.parametrize("shape", ["render-cpu-shape", "render-v5p-ports"])
def test_with_procs_per_pod_every_pod_is_a_torchrun_node_of_one_job(shape):
  # Several ranks per pod (a GPU node's 8): the trainer runs `sidecar torchrun`, whose
  # node rank, node count and master come from the pod's SIDECAR_* job.
  from sidecar._src.tools.torchrun import node_args
  jobset = render.render_jobset(render.RenderOptions(**RENDERED[shape], procs_per_pod=4))
  (rjob,) = jobset["spec"]["replicatedJobs"]
  replicas, completions = rjob["replicas"], rjob["template"]["spec"]["completions"]
  trainer = util.container(jobset, "trainer")
  assert trainer["command"] == ["sidecar", "torchrun", "--nproc-per-node", "4", "--", "python",
                                "-m", "my_pkg.train"]
  nodes = [dict(zip(*[iter(node_args(resolve_env(trainer, pod_metadata(jobset, rjob, s, h)),
                                     4))] * 2))
           for s in range(replicas) for h in range(completions)]
  assert [int(n["--node-rank"]) for n in nodes] == list(range(replicas * completions))
  assert {(n["--nnodes"], n["--nproc-per-node"]) for n in nodes} == {
      (str(replicas * completions), "4")}
  (master,) = {(n["--master-addr"], n["--master-port"]) for n in nodes}
  assert master[0] == pod_fqdn(jobset, rjob, 0, 0)
  assert {p["containerPort"]: p["name"] for p in trainer["ports"]}[int(master[1])] == (
      "coordinator")


def test_trainer_identity_matches_its_sidecars(jobset):
  # The process on pod (s, h) drives the sidecar on pod (s, h): same fields, same values.
  trainer, sidecar = util.env(jobset, "trainer"), util.env(jobset, "sidecar")
  for name in ("SIDECAR_SLICE_ID", "SIDECAR_HOST_ID"):
    assert trainer[name] == sidecar[name]
    assert "valueFrom" in trainer[name]


def test_sidecar_listens_beyond_loopback_only_with_its_token(jobset):
  env = util.env(jobset, "sidecar")
  assert env["SIDECAR_LISTEN"] == {"name": "SIDECAR_LISTEN", "value": "[::]"}
  token_dir = env["SIDECAR_TOKEN_FILE"]["value"].rpartition("/")[0]
  mounts = {m["mountPath"]: m["name"] for m in util.container(jobset, "sidecar")["volumeMounts"]}
  volumes = {v["name"]: v for v in util.pod_spec(jobset)["volumes"]}
  assert "secret" in volumes[mounts[token_dir]]


def test_local_devices_only_on_cpu_and_equal_to_the_forced_device_count(jobset):
  env = util.env(jobset, "trainer")
  if env.get("JAX_PLATFORMS", {}).get("value") != "cpu":
    assert "SIDECAR_LOCAL_DEVICES" not in env
    return
  forced = re.fullmatch(r"--xla_force_host_platform_device_count=(\d+)",
                        env["XLA_FLAGS"]["value"])
  assert forced is not None
  assert env["SIDECAR_LOCAL_DEVICES"]["value"] == forced.group(1)


def test_the_cpu_overlay_is_the_only_one_with_local_devices(rendered_overlays):
  with_local = {name for name in util.OVERLAYS
                if "SIDECAR_LOCAL_DEVICES" in util.env(rendered_overlays[name][0], "trainer")}
  assert with_local == {"cpu"}
