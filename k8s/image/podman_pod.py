"""A Kubernetes pod of the rendered JobSet, run with podman: what k8s/image/test_pod.py drives.

``sidecar k8s render`` gives the pod template; each container becomes a ``podman run`` in one
podman pod with the template's image, command, env (the downward API's fields filled in as
JobSet would), memory limit and security context (user, read-only root, capabilities, no
privilege escalation, seccomp, the pod's fsGroup; at least the hardened ones of ``HARDENED``),
and its volumes: an ``emptyDir`` is a
podman volume (tmpfs for ``medium: Memory``), a Secret a read-only directory of its keys,
``/ckpt`` a host directory as a PersistentVolume would be. The pod shares its network
namespace (``--share net``), and its PID namespace where the template says
``shareProcessNamespace: true``, as a Kubernetes pod does: each container has its own IPC
namespace and ``/dev/shm``, so the trainer can reach the arena only through the socket volume.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from sidecar._src.tools.k8s.quantity import parse_quantity

JOBSET = "train"
# What JobSet and the Job controller put in the annotations the downward API reads.
FIELDS = {
    "metadata.annotations['jobset.sigs.k8s.io/jobset-name']": JOBSET,
    "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']": "slice",
    "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-replicas']": "1",
    "metadata.annotations['jobset.sigs.k8s.io/job-index']": "0",
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
    "metadata.namespace": "default",
}
# The security context the manifests give (issue 23): the pod test holds the image to it
# whether or not the rendered manifest says it all yet; the pod's fsGroup, likewise.
HARDENED = {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}
FS_GROUP = 1000
# podman here: runc (crun cannot run on a cgroup v1 host) and limits it may set.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
# File locks (under podman's tmp dir), not its shared-memory segment /dev/shm/libpod_lock,
# which would stay behind after the test.
lock_type = "file"
"""


def render(image: str, *, shm_size: str, imports: str) -> dict[str, Any]:
  """The pod template ``sidecar k8s render`` makes for one host with ``image``."""
  out = subprocess.run(
      [sys.executable, "-m", "sidecar", "k8s", "render", "--slices", "1", "--hosts-per-slice",
       "1", "--image", image, "--shm-size", shm_size, "--import", imports, "--name", JOBSET],
      check=True, capture_output=True, text=True).stdout
  jobset = yaml.safe_load(out)
  return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


class Podman:
  """``podman`` with this machine's configuration; every call checked and bounded."""

  def __init__(self, workdir: Path):
    conf = workdir / "containers.conf"
    text = CONTAINERS_CONF
    if shutil.which("runc"):
      text += 'runtime = "runc"\n'
    conf.write_text(text)
    self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

  def __call__(self, *args: str, check: bool = True, timeout: float = 300,
               ) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, env=self.env,
                          timeout=timeout)
    if check and done.returncode != 0:
      raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}:\n"
                           f"{done.stdout}\n{done.stderr}")
    return done


@dataclasses.dataclass
class Pod:
  """One pod: its podman pod, volumes and host directories, named after ``name``."""

  podman: Podman
  name: str
  spec: dict[str, Any]
  workdir: Path
  ports: dict[int, int]  # container port -> the host port it is published on
  containers: list[str] = dataclasses.field(default_factory=list)
  volumes: list[str] = dataclasses.field(default_factory=list)
  token: str = dataclasses.field(default_factory=lambda: "pod-test-" + os.urandom(16).hex())

  @property
  def ckpt(self) -> Path:
    """The host directory that stands for the PersistentVolume at /ckpt."""
    return self.workdir / "ckpt"

  @property
  def fs_group(self) -> int:
    return (self.spec.get("securityContext") or {}).get("fsGroup", FS_GROUP)

  def create(self) -> Pod:
    publish = [f"--publish=127.0.0.1:{h}:{c}" for c, h in self.ports.items()]
    share = "net,pid" if self.spec.get("shareProcessNamespace") else "net"
    self.podman("pod", "create", "--name", self.name, "--share", share, *publish)
    self.ckpt.mkdir()
    os.chown(self.ckpt, 0, self.fs_group)  # what a pod fsGroup makes of a volume
    os.chmod(self.ckpt, 0o2775)
    return self

  def volume(self, name: str, source: dict[str, Any]) -> str:
    """The ``-v`` source of pod volume ``name``."""
    if "emptyDir" in source:
      full = f"{self.name}-{name}"
      if full not in self.volumes:
        opts = (["--opt", "type=tmpfs", "--opt", "device=tmpfs", "--opt", "o=mode=0777"]
                if source["emptyDir"].get("medium") == "Memory" else [])
        self.podman("volume", "create", *opts, full)
        self.volumes.append(full)
      return full
    if "secret" in source:  # the keys as files, group-readable by the fsGroup (as kubelet)
      directory = self.workdir / f"secret-{name}"
      if not directory.exists():
        directory.mkdir()
        token = directory / "token"
        token.write_text(self.token)
        os.chown(token, 0, self.fs_group)
        os.chmod(token, source["secret"].get("defaultMode", 0o644) | 0o040)
      return str(directory)
    raise AssertionError(f"the pod test has no stand-in for volume {name}: {source}")

  def run_args(self, container: dict[str, Any], *, env: dict[str, str] | None = None,
               ckpt: str = "rw", drop_mounts: tuple[str, ...] = (),
               extra: tuple[str, ...] = ()) -> list[str]:
    """``podman run`` arguments for ``container`` of the pod template, as kubelet runs it."""
    args = ["--pod", self.name]
    values = {}
    for e in container.get("env", []):
      values[e["name"]] = (e["value"] if "value" in e
                           else FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]])
    values.update(env or {})
    for k, v in values.items():
      args += ["--env", f"{k}={v}"]
    limit = (container.get("resources", {}).get("limits", {}) or {}).get("memory")
    if limit:
      args += ["--memory", str(parse_quantity(limit)), "--memory-swap", str(parse_quantity(limit))]
    pod_sc = {"fsGroup": self.fs_group, **(self.spec.get("securityContext") or {})}
    args += security_args({**pod_sc, **(container.get("securityContext") or {}), **HARDENED})
    sources = {v["name"]: v for v in self.spec.get("volumes", [])}
    for m in container.get("volumeMounts", []):
      if m["mountPath"] in drop_mounts:
        continue
      src = self.volume(m["name"], sources[m["name"]])
      args += ["--volume", f"{src}:{m['mountPath']}" + (":ro" if m.get("readOnly") else "")]
    if "/ckpt" not in drop_mounts:
      args += ["--volume", f"{self.ckpt}:/ckpt" + (":ro" if ckpt == "ro" else "")]
    return [*args, *extra]

  def start(self, cname: str, container: dict[str, Any], command: list[str], **kw) -> str:
    """``podman run -d`` of ``container`` as ``cname`` running ``command``."""
    full = f"{self.name}-{cname}"
    self.podman("run", "-d", "--name", full, *self.run_args(container, **kw),
                "--entrypoint", command[0], container["image"], *command[1:])
    self.containers.append(full)
    return full

  def run(self, container: dict[str, Any], command: list[str], *, timeout: float = 300,
          **kw) -> subprocess.CompletedProcess:
    """``podman run --rm`` of ``container`` running ``command``, to its end."""
    return self.podman("run", "--rm", *self.run_args(container, **kw),
                       "--entrypoint", command[0], container["image"], *command[1:],
                       check=False, timeout=timeout)

  def logs(self, full: str) -> str:
    done = self.podman("logs", full, check=False)
    return done.stdout + done.stderr

  def close(self) -> None:
    for c in self.containers:
      self.podman("rm", "-f", "-t", "0", c, check=False)
    self.podman("pod", "rm", "-f", self.name, check=False)
    for v in self.volumes:
      self.podman("volume", "rm", "-f", v, check=False)


def security_args(sc: dict[str, Any]) -> list[str]:
  """podman flags for a (pod-level merged with container-level) securityContext."""
  if sc.get("privileged"):
    raise AssertionError("a privileged container is not what the manifests mean to run")
  args = []
  if "runAsUser" in sc:
    args += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
  args += ["--group-add", str(sc.get("fsGroup", FS_GROUP))]
  for g in sc.get("supplementalGroups", []):
    args += ["--group-add", str(g)]
  if sc.get("readOnlyRootFilesystem"):
    args += ["--read-only", "--read-only-tmpfs=false"]  # no tmpfs on /tmp, /run: as kubelet
  if sc.get("allowPrivilegeEscalation") is False:
    args += ["--security-opt", "no-new-privileges"]
  caps = sc.get("capabilities") or {}
  args += [f"--cap-drop={c}" for c in caps.get("drop", [])]
  args += [f"--cap-add={c}" for c in caps.get("add", [])]
  seccomp = (sc.get("seccompProfile") or {}).get("type")
  if seccomp == "Unconfined":
    args += ["--security-opt", "seccomp=unconfined"]
  return args  # seccomp RuntimeDefault: podman's default profile


def result(output: str) -> dict[str, Any]:
  """The ``RESULT {...}`` line pod_trainer.py prints."""
  for line in output.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  raise AssertionError(f"the trainer printed no RESULT line:\n{output[-4000:]}")


def wait_for(predicate, *, timeout: float, what: str, poll: float = 0.1):
  deadline = time.monotonic() + timeout
  while True:
    value = predicate()
    if value:
      return value
    if time.monotonic() > deadline:
      raise AssertionError(f"{what}: not within {timeout:.0f} s")
    time.sleep(poll)
