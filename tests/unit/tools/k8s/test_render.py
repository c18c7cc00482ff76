"""``sidecar k8s render``'s options and the JobSets they render, checked without kubectl."""

from __future__ import annotations

import pytest

from sidecar._src.core import errors
from sidecar._src.tools.k8s import checks, render
from tests.support import k8s_util as util

pytestmark = pytest.mark.unit


def test_no_metrics_renders_no_port_env_or_annotations():
  doc = render.render_jobset(render.RenderOptions(slices=1, hosts_per_slice=1, image="s:1",
                                                  metrics_port=None))
  template = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
  assert "metadata" not in template
  assert [p["name"] for p in util.container(doc, "sidecar")["ports"]] == ["grpc", "health"]
  assert "SIDECAR_METRICS_PORT" not in util.env(doc, "sidecar")
  assert checks.check_documents([doc], crd_path=util.CRD) == []
  with pytest.raises(errors.InvalidArgumentError, match="metrics_port 8491 is also the port"):
    render.RenderOptions(slices=1, hosts_per_slice=1, image="s:1", metrics_port=8491)


@pytest.mark.parametrize("options", [
    dict(slices=1, hosts_per_slice=1, image="sidecar:1"),
    dict(slices=3, hosts_per_slice=4, image="sidecar:1", shm_size="256MiB"),
    dict(slices=4, hosts_per_slice=16, image="sidecar:1", tpu=render.parse_tpu("v6e:8x8"),
         shm_size="64GiB", imports=("a.fns", "b.fns"), namespace="ml", name="big-run"),
    dict(slices=2, hosts_per_slice=8, image="sidecar:1", tpu=render.parse_tpu("v5p:2x4x4"),
         port=9000, health_port=9001, coordinator_port=9002, grace_seconds=900),
], ids=["minimal", "cpu", "v6e-namespace", "v5p-ports"])
def test_rendered_jobsets_pass_every_check(options):
  doc = render.render_jobset(render.RenderOptions(**options))
  assert checks.check_documents([doc], crd_path=util.CRD) == []
  rjob = doc["spec"]["replicatedJobs"][0]
  assert rjob["replicas"] == options["slices"]
  assert rjob["template"]["spec"]["completions"] == options["hosts_per_slice"]


@pytest.mark.parametrize("text, accelerator, chips, hosts", [
    ("v5e:4x4", "tpu-v5-lite-podslice", 4, 4),
    ("v5e:2x4", "tpu-v5-lite-podslice", 8, 1),
    ("v5e:1x1", "tpu-v5-lite-podslice", 1, 1),
    ("v6e:16x16", "tpu-v6e-slice", 4, 64),
    ("v5p:2x2x1", "tpu-v5p-slice", 4, 1),
    ("v4:2x2x4", "tpu-v4-podslice", 4, 4),
], ids=["v5e-multi-host", "v5e-8-chip-host", "v5e-one-chip", "v6e-pod", "v5p-one-host", "v4"])
def test_parse_tpu(text, accelerator, chips, hosts):
  tpu = render.parse_tpu(text)
  assert (tpu.accelerator, tpu.chips_per_host, tpu.hosts) == (accelerator, chips, hosts)
  assert tpu.topology == text.split(":")[1]


@pytest.mark.parametrize("text, match", [
    ("v5e", r"is not VERSION:TOPOLOGY with VERSION one of v4, v5p, v5e, v6e"),
    ("v9:4x4", r"'v9:4x4' is not VERSION:TOPOLOGY"),
    ("v5e:4x4x4", r"TPU v5e topologies have 2 dimensions, e\.g\. v5e:4x4"),
    ("v5p:4x4", r"TPU v5p topologies have 3 dimensions, e\.g\. v5p:2x2x4"),
    ("v5e:0x4", r"TPU v5e topologies have 2 dimensions"),
    ("v5e:3x3", r"9 chips do not split into hosts of 4"),
], ids=["no-topology", "unknown-version", "v5e-3d", "v5p-2d", "zero", "odd-chips"])
def test_bad_tpu_names_the_fix(text, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    render.parse_tpu(text)


@pytest.mark.parametrize("options, match", [
    (dict(slices=0, hosts_per_slice=1), r"slices must be an integer >= 1, got 0"),
    (dict(slices=1, hosts_per_slice=2, tpu=render.parse_tpu("v5e:4x4")),
     r"hosts_per_slice is 2 but TPU topology 4x4 has 4 hosts of 4 chips"),
    (dict(slices=1, hosts_per_slice=1, name="Train_1"), r"name must be a DNS label"),
    (dict(slices=1, hosts_per_slice=1, shm_size="lots"), r"shm_size: cannot parse size 'lots'"),
    (dict(slices=1, hosts_per_slice=1, port=9000, health_port=9000),
     r"port and health_port must differ, both are 9000"),
    (dict(slices=1, hosts_per_slice=1, coordinator_port=8491),
     r"coordinator_port 8491 is also a sidecar port \(port 8490, health_port 8491\); pick "
     r"another"),
    (dict(slices=1, hosts_per_slice=1, trainer_restarts=-1),
     r"trainer_restarts must be an integer >= 0, got -1"),
    (dict(slices=1, hosts_per_slice=1, port=70000),
     r"port \(--port\) must be a TCP port in 1\.\.65535, got 70000"),
    (dict(slices=1, hosts_per_slice=1, health_port=0),
     r"health_port \(--health-port\) must be a TCP port in 1\.\.65535, got 0"),
    (dict(slices=1, hosts_per_slice=1, coordinator_port=-1),
     r"coordinator_port \(--coordinator-port\) must be a TCP port in 1\.\.65535, got -1"),
    (dict(slices=1, hosts_per_slice=1, metrics_port=99999),
     r"metrics_port \(--metrics-port\) must be a TCP port in 1\.\.65535, got 99999"),
], ids=["zero-slices", "hosts-vs-tpu", "bad-name", "bad-shm", "same-ports",
        "coordinator-on-sidecar-port", "negative-restarts", "port-70000", "health-port-0",
        "coordinator-port-minus-1", "metrics-port-99999"])
def test_bad_options_name_the_value(options, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    render.RenderOptions(image="sidecar:1", **options)


def test_procs_per_pod_runs_the_trainer_under_sidecar_torchrun():
  one = render.render_jobset(render.RenderOptions(slices=1, hosts_per_slice=2, image="s:1"))
  eight = render.render_jobset(render.RenderOptions(slices=1, hosts_per_slice=2, image="s:1",
                                                    procs_per_pod=8))
  assert util.container(one, "trainer")["command"] == ["python", "-m", "my_pkg.train"]
  assert util.container(eight, "trainer")["command"] == [
      "sidecar", "torchrun", "--nproc-per-node", "8", "--", "python", "-m", "my_pkg.train"]
  assert checks.check_jobset(eight, kubernetes_versions=()) == []
  with pytest.raises(errors.InvalidArgumentError,
                     match="procs_per_pod must be an integer >= 1, got 0"):
    render.RenderOptions(slices=1, hosts_per_slice=1, image="s:1", procs_per_pod=0)


@pytest.mark.parametrize("procs, share", [(1, None), (2, "0.48"), (8, "0.12")],
                         ids=["one-rank", "two-ranks", "eight-ranks"])
def test_ranks_of_a_pod_each_get_a_share_of_the_arena_and_check_wants_one(procs, share):
  """Issue 35 item 8: P ranks shared the default 0.9 quota, so one took 57 of 64 MiB."""
  doc = render.render_jobset(render.RenderOptions(slices=1, hosts_per_slice=2, image="s:1",
                                                  procs_per_pod=procs))
  quota = util.env(doc, "sidecar").get("SIDECAR_SESSION_QUOTA")
  assert (quota and quota["value"]) == share
  sidecar = util.container(doc, "sidecar")
  sidecar["env"] = [e for e in sidecar["env"] if e["name"] != "SIDECAR_SESSION_QUOTA"]
  found = [str(f) for f in checks.check_jobset(doc, kubernetes_versions=())]
  assert found == ([] if procs == 1 else [
      "JobSet train: spec.replicatedJobs[0].template.spec.template.spec.initContainers[0].env: "
      f"{procs} ranks share this sidecar (torchrun --nproc-per-node {procs}) but it sets no "
      "SIDECAR_SESSION_QUOTA: one rank may take 0.9 of the arena and its neighbours are "
      f"refused; set SIDECAR_SESSION_QUOTA={share} (about 1/{procs})"])


def test_the_trainer_is_probed_for_stalls_against_its_own_sidecar():
  doc = render.render_jobset(render.RenderOptions(slices=1, hosts_per_slice=1, image="s:1",
                                                  port=9000))
  trainer = util.container(doc, "trainer")
  assert trainer["livenessProbe"]["exec"]["command"] == [
      "sidecar", "stalls", "localhost:9000", "--stacks"]
  assert util.env(doc, "trainer")["SIDECAR_STACKS_SIGNAL"]["value"] == "SIGUSR2"
  assert util.env(doc, "sidecar")["SIDECAR_STALL_TIMEOUT"]["value"] == "120"
  assert checks.check_documents([doc], crd_path=util.CRD) == []


def test_the_pod_shares_one_pid_namespace_so_the_probe_can_ask_for_stacks():
  # issue 69: the sidecar knows a trainer's pid from the kernel only where both containers
  # share a PID namespace; the probe signals no other (tools/stalls.py `_unsignalled`).
  doc = render.render_jobset(render.RenderOptions(slices=1, hosts_per_slice=1, image="s:1"))
  assert util.pod_spec(doc)["shareProcessNamespace"] is True
  assert checks.check_documents([doc], crd_path=util.CRD) == []
  apart = render.render_jobset(render.RenderOptions(slices=1, hosts_per_slice=1, image="s:1",
                                                    share_process_namespace=False))
  assert "shareProcessNamespace" not in util.pod_spec(apart)
  assert checks.check_documents([apart], crd_path=util.CRD) == []
