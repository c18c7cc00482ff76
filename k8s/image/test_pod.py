"""The image, built and run as the manifests run it: a pod of a sidecar and a trainer, in podman.

`.ci/run` runs this after the suite (`.venv/bin/pytest k8s/image`); the suite itself
(`pytest`, whose testpaths are tests/) does not: it needs root and podman, and a first build
takes minutes. Later builds reuse podman's layer cache. k8s/image/README.md says why and
what it measures.

In order, in one pod rendered by `sidecar k8s render --image TAG`: the image has nothing of
its build and nothing uid 1000 may write outside its home; the sidecar container serves
(health, the HEALTHCHECK, metrics) under the manifests' env and security context; a trainer
container maps the arena through the socket volume and feeds, saves and restores; `podman
kill` of the sidecar gives it HostLostError; the restarted sidecar serves again and a new
trainer restores the last durable step from /ckpt. Then the bad inputs, each in a pod of its
own: no socket volume, a read-only /ckpt, an arena above the memory limit, other versions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from podman_pod import Pod, Podman, render, result, wait_for  # k8s/image/, beside this file

from sidecar._src.arena.shm import format_size
from sidecar._src.tools import health
from sidecar._src.tools.k8s.quantity import parse_quantity

pytestmark = pytest.mark.timeout(1800)  # a first build downloads and installs every wheel

HERE = Path(__file__).resolve().parent
BUILD = HERE / "build.sh"
TAG = os.environ.get("SIDECAR_TEST_IMAGE", "localhost/sidecar:test")
SHM = "256MiB"  # the render makes the sidecar's memory limit this + render.ARENA_OVERHEAD
POD_CODE = "/podtest"  # k8s/image/pod, read-only: the user's package and the trainer


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
  if not shutil.which("podman") or os.getuid() != 0:
    if os.environ.get("CI"):
      pytest.fail("the image test needs podman, as root: .ci/run installs it "
                  "(apt-get install podman buildah runc debootstrap)")
    pytest.skip("needs podman, as root")
  return Podman(tmp_path_factory.mktemp("podman"))


@pytest.fixture(scope="module")
def image(podman, figures):
  start = time.monotonic()
  done = subprocess.run([str(BUILD), "--tag", TAG, "--engine", "podman"], env=podman.env,
                        capture_output=True, text=True, timeout=1700)
  assert done.returncode == 0, f"build.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
  figures["build (build.sh, this run)"] = f"{time.monotonic() - start:.0f} s"
  size = int(podman("image", "inspect", "--format", "{{.Size}}", TAG).stdout)
  figures["image size"] = f"{size / 1e6:.0f} MB"
  return TAG


@pytest.fixture(scope="module")
def spec(image):
  return render(image, shm_size=SHM, imports="pod_fns")


def free_ports(n: int) -> list[int]:
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def container(spec, name):
  return next(c for c in spec.get("initContainers", []) + spec["containers"]
              if c["name"] == name)


def sidecar_env():
  # The manifests' environment unchanged (no SIDECAR_DEVICE_IDS: the lone trainer, which
  # owns both CPU devices, takes them as its host's at attach); the user's package is the
  # read-only pod/ directory.
  return {"PYTHONPATH": POD_CODE}


def code_mount() -> tuple[str, ...]:
  return ("--volume", f"{HERE / 'pod'}:{POD_CODE}:ro")


@pytest.fixture(scope="module")
def pod(podman, spec, tmp_path_factory):
  grpc_port, health_port, metrics_port = free_ports(3)
  p = Pod(podman, f"sidecar-pod-{os.getpid()}", spec, tmp_path_factory.mktemp("pod"),
          ports={8490: grpc_port, 8491: health_port, 8492: metrics_port}).create()
  yield p
  p.close()


def serving(pod: Pod) -> bool:
  return health.check(f"127.0.0.1:{pod.ports[8491]}", timeout=1)[0]


def start_sidecar(pod: Pod, spec) -> str:
  sc = container(spec, "sidecar")
  return pod.start("sidecar", sc, sc["command"], env=sidecar_env(), extra=code_mount())


def trainer(pod: Pod, spec, mode: str, **kw):
  tr = container(spec, "trainer")
  return pod.run(tr, ["python3", f"{POD_CODE}/pod_trainer.py", mode],
                 extra=code_mount() + kw.pop("extra", ()), **kw)


def test_the_image_holds_nothing_of_its_build_and_nothing_uid_1000_may_write(podman, image,
                                                                            figures):
  inspected = json.loads(podman("image", "inspect", image).stdout)[0]
  check_cmd = (inspected.get("Healthcheck") or inspected["Config"].get("Healthcheck"))["Test"]
  assert inspected["Config"]["User"] == "1000:1000" and check_cmd == ["CMD", "sidecar", "health"]
  labels = podman("image", "inspect", "--format",
                  "{{index .Labels \"colocated-sidecar.pip-freeze\"}}", image).stdout.split()
  check = ("cat /opt/sidecar/pip-freeze.txt; echo ==;"
           " ls -d /wheels /src /opt/build /root/.cache/pip 2>/dev/null || true; echo ==;"
           " command -v gcc cc make 2>/dev/null || true; echo ==;"
           " find / -xdev -writable ! -path '/home/sidecar*' 2>/dev/null || true; echo ==;"
           " find / -xdev -user 1000 ! -path '/home/sidecar*' 2>/dev/null || true; echo ==;"
           " id -u; id -g")
  done = podman("run", "--rm", "--no-healthcheck", "--network", "none", "--entrypoint", "sh",
                image, "-c", check)
  freeze, leftovers, compilers, writable, owned, ids = done.stdout.split("==\n")
  assert labels == freeze.split() and "colocated-sidecar==0.2.0" in labels
  assert (leftovers, compilers) == ("", ""), "the build left sources, wheels or compilers"
  assert (writable, owned) == ("", ""), f"uid 1000 may write outside its home: {writable}{owned}"
  assert ids.split() == ["1000", "1000"]
  figures["packages (pip freeze, also the label)"] = str(len(labels))


def test_the_sidecar_serves_as_the_manifests_run_it(podman, pod, spec, figures):
  sc = container(spec, "sidecar")
  assert sc["command"] == ["sidecar", "serve"] and sc.get("restartPolicy") == "Always"
  start = time.monotonic()
  name = start_sidecar(pod, spec)
  wait_for(lambda: serving(pod), timeout=300, what="the sidecar answering SERVING")
  figures["podman run to SERVING"] = f"{time.monotonic() - start:.1f} s"
  # It names the address it dials (a [::] listen is reached on loopback); the health port
  # mapped from outside the pod answered above, so it listens beyond the pod's loopback.
  assert "serving on 127.0.0.1:8490" in pod.logs(name)
  assert podman("healthcheck", "run", name).returncode == 0  # the image's HEALTHCHECK
  metrics = urllib.request.urlopen(f"http://127.0.0.1:{pod.ports[8492]}/metrics",
                                   timeout=10).read().decode()
  assert re.search(r"^sidecar_arena_size_bytes(\{[^}]*\})? 2.68435456e\+08$", metrics, re.M)


def test_a_trainer_feeds_saves_and_restores_through_the_socket_volume(pod, spec):
  done = trainer(pod, spec, "train")
  r = result(done.stdout + done.stderr)
  assert r["arena_mapped"] and r["restored_ok"] and r["steps"] == [1, 2, 3]
  assert len(r["batches"]) == 5 and all(len(b) == 8 for b in r["batches"])
  assert r["sidecar_ipc"] != r["trainer_ipc"], "the containers share an IPC namespace"
  assert r["dev_shm"] == [], "the trainer found files in its /dev/shm"
  assert r["sidecar_uid"] == r["trainer_uid"] == 1000
  assert r["checkpoint_metrics"] and r["metrics_lines"] > 50


def test_killing_the_sidecar_container_gives_the_trainer_host_lost(podman, pod, spec):
  tr = container(spec, "trainer")
  name = pod.start("trainer-hold", tr, ["python3", f"{POD_CODE}/pod_trainer.py", "hold"],
                   extra=code_mount())
  wait_for(lambda: "READY" in pod.logs(name) or "RESULT" in pod.logs(name), timeout=300,
           what="the holding trainer's first batch")
  podman("kill", f"{pod.name}-sidecar")
  podman("wait", name, timeout=120)
  r = result(pod.logs(name))
  assert r["error"] == "HostLostError", r
  assert "is gone" in r["message"]


def test_a_restarted_sidecar_serves_and_the_trainer_restores_the_last_durable_step(
    podman, pod, spec, figures):
  start = time.monotonic()
  podman("start", f"{pod.name}-sidecar")  # as kubelet restarts a native sidecar in place
  wait_for(lambda: serving(pod), timeout=300, what="the restarted sidecar answering SERVING")
  figures["podman start (restart) to SERVING"] = f"{time.monotonic() - start:.1f} s"
  done = trainer(pod, spec, "restore")
  r = result(done.stdout + done.stderr)
  assert r["step"] == 4 and r["restored_ok"], r  # step 4: saved and durable before the kill


@pytest.fixture
def bad_pod(podman, spec, tmp_path):
  p = Pod(podman, f"sidecar-bad-{os.getpid()}", spec, tmp_path, ports={}).create()
  yield p
  p.close()


@pytest.mark.parametrize("case,kw,message", [pytest.param(*p, id=p[0]) for p in [
    ("no socket volume", {"drop_mounts": ("/run/sidecar",)},
     r"cannot make the worker socket /run/sidecar/sidecar.sock: /run is on a read-only file "
     r"system. Mount a writable volume at /run/sidecar, shared with the trainer"),
    ("read-only /ckpt", {"ckpt": "ro"},
     r"checkpoint root /ckpt \(--checkpoint-root, \$SIDECAR_CHECKPOINT_ROOTS\) cannot take "
     r"checkpoints: /ckpt is on a read-only file system. Mount the checkpoint volume there "
     r"read-write"),
    # Twice the rendered limit (the arena + render.ARENA_OVERHEAD), whatever that overhead is.
    ("arena above the memory limit", {"env": {"SIDECAR_SHM_SIZE": "2xlimit"}},
     r"the arena needs {arena} .* \(cgroup memory\.(max|limit_in_bytes) {limit} with .* in "
     r"use\); lower --shm-size or give the sidecar more memory"),
]])
def test_a_sidecar_without_what_it_needs_exits_at_once_saying_what_to_fix(bad_pod, spec, case,
                                                                          kw, message, figures):
  sc = container(spec, "sidecar")
  env = {**sidecar_env(), **kw.get("env", {})}
  if env.get("SIDECAR_SHM_SIZE") == "2xlimit":
    limit = parse_quantity(sc["resources"]["limits"]["memory"])
    env["SIDECAR_SHM_SIZE"] = str(2 * limit)
    message = message.format(arena=re.escape(format_size(2 * limit)),
                             limit=re.escape(format_size(limit)))
  kw = {**kw, "env": env}
  start = time.monotonic()
  done = bad_pod.run(sc, sc["command"], timeout=120, extra=code_mount(), **kw)
  figures[f"exit with {case}"] = f"{time.monotonic() - start:.1f} s"
  assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
  assert re.search(message, done.stderr), done.stderr


def test_a_trainer_of_other_versions_gets_version_mismatch_listing_each(pod, spec, tmp_path):
  # An older trainer image: its colocated-sidecar and jax report other versions.
  fake = tmp_path / "versions"
  for name, version in (("colocated_sidecar", "0.0.1"), ("jax", "0.4.1")):
    info = fake / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\n"
                                   f"Version: {version}\n")
  os.chmod(tmp_path, 0o755)
  done = trainer(pod, spec, "handshake", env={"PYTHONPATH": "/versions"},
                 extra=("--volume", f"{fake}:/versions:ro"))
  r = result(done.stdout + done.stderr)
  assert r["error"] == "VersionMismatchError", r
  assert "package: 0.0.1 here, 0.2.0 there" in r["message"], r["message"]
  assert "jax: 0.4.1 here, 0.10" in r["message"], r["message"]

