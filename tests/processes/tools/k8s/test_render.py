"""`sidecar k8s render`: the same JobSet as the overlays, through the same checks."""

from __future__ import annotations

import argparse

import pytest
import yaml

from sidecar._src.tools.k8s import checks, cli as k8s_cli, render
from tests.support import k8s_util as util

pytestmark = pytest.mark.processes

GKE_IMAGES = dict(image="us-docker.pkg.dev/my-project/my-repo/sidecar:latest",
                  trainer_image="us-docker.pkg.dev/my-project/my-repo/trainer:latest")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="sidecar")
  k8s_cli.register(p.add_subparsers())
  return p


def run_cli(argv, capsys):
  args = parser().parse_args(argv)
  status = args.func(args)
  out, err = capsys.readouterr()
  return status, out, err


def test_render_equals_the_gke_overlay(rendered_overlays):
  (overlay,) = rendered_overlays["gke-tpu-multislice"]
  rendered = render.render_jobset(render.RenderOptions(
      slices=2, hosts_per_slice=4, tpu=render.parse_tpu("v5e:4x4"), shm_size="32GiB",
      sidecar_cpu="8", **GKE_IMAGES))
  assert util.normalized(rendered) == util.normalized(overlay)


def test_cli_render_prints_a_jobset_that_passes_every_check(capsys):
  status, out, _ = run_cli(["k8s", "render", "--slices", "2", "--image", "sidecar:1",
                            "--tpu", "v5e:4x4", "--import", "my_pkg.fns",
                            "--trainer-command", "python -m my_pkg.train --steps 10"], capsys)
  assert status == 0
  assert out.startswith("# Rendered by: sidecar k8s render\n")
  (doc,) = checks.load_documents(out)
  assert doc["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] == 4
  assert util.env(doc, "sidecar")["SIDECAR_IMPORTS"]["value"] == "my_pkg.fns"
  assert util.container(doc, "trainer")["command"] == [
      "python", "-m", "my_pkg.train", "--steps", "10"]
  assert checks.check_documents([doc], crd_path=util.CRD) == []


@pytest.mark.parametrize("flags, policy, backoff", [
    ([], "OnFailure", 4), (["--trainer-restarts", "9"], "OnFailure", 9),
    (["--trainer-restarts", "0"], "Never", 0)], ids=["default", "nine", "none"])
def test_cli_render_lets_trainers_restart_in_place_beside_the_sidecar(
    capsys, rendered_overlays, flags, policy, backoff):
  # The kubelet restarts a failed trainer in its pod; the native sidecar, with its arena
  # and RAM tier, keeps running (docs/kubernetes.md, "Losing a host").
  status, out, _ = run_cli(["k8s", "render", "--slices", "1", "--hosts-per-slice", "2",
                            "--image", "sidecar:1", *flags], capsys)
  assert status == 0
  (doc,) = checks.load_documents(out)
  job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert (job["template"]["spec"]["restartPolicy"], job["backoffLimit"]) == (policy, backoff)
  assert util.container(doc, "sidecar")["restartPolicy"] == "Always"
  assert checks.check_documents([doc], crd_path=util.CRD) == []
  for name, (overlay,) in rendered_overlays.items():  # the kustomize overlays, the same
    job = overlay["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["template"]["spec"]["restartPolicy"], job["backoffLimit"]) == (
        "OnFailure", 4), name


@pytest.mark.parametrize("flags, shared", [([], True), (["--no-share-process-namespace"], None)],
                         ids=["default", "apart"])
def test_cli_render_shares_the_pods_pid_namespace_as_the_overlays_do(
    capsys, rendered_overlays, flags, shared):
  # The trainer's probe asks a stalled trainer for its stacks only by the pid its sidecar
  # had from the kernel, in the probe's own PID namespace (issue 69).
  status, out, _ = run_cli(["k8s", "render", "--image", "sidecar:1", *flags], capsys)
  assert status == 0
  (doc,) = checks.load_documents(out)
  assert util.pod_spec(doc).get("shareProcessNamespace") is shared
  assert checks.check_documents([doc], crd_path=util.CRD) == []
  for name, (overlay,) in rendered_overlays.items():
    assert util.pod_spec(overlay)["shareProcessNamespace"] is True, name


def test_cli_render_sets_the_coordinator_port_and_hosts_from_its_arguments(capsys):
  status, out, _ = run_cli(["k8s", "render", "--slices", "3", "--hosts-per-slice", "2",
                            "--image", "sidecar:1", "--coordinator-port", "9100"], capsys)
  assert status == 0
  (doc,) = checks.load_documents(out)
  assert util.container(doc, "trainer")["ports"] == [
      {"name": "coordinator", "containerPort": 9100}]
  env = util.env(doc, "trainer")
  assert env["SIDECAR_COORDINATOR_PORT"]["value"] == "9100"
  assert env["SIDECAR_HOSTS_PER_SLICE"]["value"] == "2"
  assert checks.check_documents([doc], crd_path=util.CRD) == []


@pytest.mark.parametrize("flags, slices, hosts", [
    ([], 1, 1), (["--tpu", "v5e:4x4"], 1, 4), (["--slices", "2"], 2, 1)],
    ids=["readme-line", "tpu", "slices"])
def test_cli_render_defaults_to_one_slice_of_one_pod_or_the_tpus_hosts(
    capsys, flags, slices, hosts):
  # The README's line, `sidecar k8s render --image REGISTRY/sidecar:TAG`, as written.
  status, out, err = run_cli(["k8s", "render", "--image", "REGISTRY/sidecar:TAG", *flags],
                             capsys)
  assert (status, err) == (0, "")
  (doc,) = checks.load_documents(out)
  job = doc["spec"]["replicatedJobs"][0]
  assert (job["replicas"], job["template"]["spec"]["completions"]) == (slices, hosts)
  assert util.env(doc, "trainer")["SIDECAR_HOSTS_PER_SLICE"]["value"] == str(hosts)
  assert checks.check_documents([doc], crd_path=util.CRD) == []


def test_cli_render_rejects_a_bad_tpu_with_its_message(capsys):
  with pytest.raises(SystemExit):
    parser().parse_args(["k8s", "render", "--slices", "1", "--image", "i", "--tpu", "v5e:3x3"])
  assert "9 chips do not split into hosts of 4" in capsys.readouterr().err


def test_cli_render_writes_the_output_file(tmp_path, capsys):
  path = tmp_path / "jobset.yaml"
  status, out, _ = run_cli(["k8s", "render", "--slices", "1", "--hosts-per-slice", "2",
                            "--image", "sidecar:1", "-o", str(path)], capsys)
  assert (status, out) == (0, "")
  assert yaml.safe_load(path.read_text())["kind"] == "JobSet"


def test_cli_check_passes_a_good_file_and_fails_a_planted_error(tmp_path, capsys):
  doc = render.render_jobset(render.RenderOptions(slices=1, hosts_per_slice=2, image="i"))
  good = tmp_path / "good.yaml"
  good.write_text(render.to_yaml(doc))
  status, out, err = run_cli(["k8s", "check", str(good), "--crd", str(util.CRD)], capsys)
  assert (status, out) == (0, "")
  assert "0 problem(s) in 1 file(s)" in err

  util.container(doc, "sidecar").pop("restartPolicy")
  bad = tmp_path / "bad.yaml"
  bad.write_text(render.to_yaml(doc))
  status, out, err = run_cli(["k8s", "check", str(bad), "--no-pod-schema"], capsys)
  assert status == 1
  assert f"{bad}: JobSet train: spec.replicatedJobs[0].template.spec.template.spec." in out
  assert "the sidecar must be a native sidecar" in out
  assert "JobSet schema not checked; pass --crd FILE" in err


def test_cli_check_reports_a_missing_file(tmp_path, capsys):
  status, _, err = run_cli(["k8s", "check", str(tmp_path / "nope.yaml")], capsys)
  assert status == 2
  assert "nope.yaml" in err and "No such file" in err


def test_cli_check_reports_bad_yaml(tmp_path, capsys):
  path = tmp_path / "bad.yaml"
  path.write_text("kind: JobSet\n  spec: [\n")
  status, _, err = run_cli(["k8s", "check", str(path)], capsys)
  assert status == 2
  assert f"sidecar k8s check: {path}:" in err
