"""Renders a ready JobSet with the sidecar, for users who don't use kustomize.

It prints what ``kubectl kustomize k8s/overlays/gke-tpu-multislice`` prints, for any number
of slices, hosts and TPU shape (a test keeps the two equal).

Example::

  doc = render_jobset(RenderOptions(slices=2, hosts_per_slice=4, image="sidecar:1",
                                    tpu=parse_tpu("v5e:4x4")))
  print(to_yaml(doc))
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import yaml

from sidecar._src.arena import shm
from sidecar._src.core import errors, stall
from sidecar._src.tools import torchrun
from sidecar._src.tools.k8s import quantity

SOCKET_DIR = "/run/sidecar"
IMAGE_UID = "1000"  # the image's sidecar user (Dockerfile: USER 1000:1000)
TOKEN_DIR = "/var/run/secrets/sidecar"
REPLICA_TOKEN_DIR = "/var/run/secrets/sidecar-peer"  # the sidecar's alone: only peers send replicas
# The sidecar's checkpoint root (SIDECAR_CHECKPOINT_ROOTS): mount the checkpoint volume here.
CHECKPOINT_ROOT = "/ckpt"
ARENA_OVERHEAD = 1024 * 2**20


@dataclasses.dataclass(frozen=True, slots=True)
class _TpuKind:
  accelerator: str  # the cloud.google.com/gke-tpu-accelerator node label
  dims: int
  max_single_host_chips: int  # larger slices have 4 chips per host


_TPU_KINDS = {
    "v4": _TpuKind("tpu-v4-podslice", 3, 4),
    "v5p": _TpuKind("tpu-v5p-slice", 3, 4),
    "v5e": _TpuKind("tpu-v5-lite-podslice", 2, 8),
    "v6e": _TpuKind("tpu-v6e-slice", 2, 8),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TpuSpec:
  """A TPU slice shape on GKE: accelerator label, topology and chips per host."""
  accelerator: str
  topology: str
  chips_per_host: int
  hosts: int


def parse_tpu(text: str) -> TpuSpec:
  """Parses ``VERSION:TOPOLOGY``, e.g. ``v5e:4x4``, ``v6e:2x4``, ``v5p:2x2x4``."""
  version, sep, topology = text.strip().partition(":")
  kind = _TPU_KINDS.get(version.lower())
  if not sep or kind is None:
    raise errors.InvalidArgumentError(
        f"--tpu {text!r} is not VERSION:TOPOLOGY with VERSION one of "
        f"{', '.join(_TPU_KINDS)}; e.g. v5e:4x4")
  if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)*", topology) or (
      topology.count("x") + 1 != kind.dims):
    example = "4x4" if kind.dims == 2 else "2x2x4"
    raise errors.InvalidArgumentError(
        f"--tpu {text!r}: TPU {version} topologies have {kind.dims} dimensions, e.g. "
        f"{version}:{example}")
  chips = math.prod(int(d) for d in topology.split("x"))
  per_host = chips if chips <= kind.max_single_host_chips else 4
  if chips % per_host:
    raise errors.InvalidArgumentError(
        f"--tpu {text!r}: {chips} chips do not split into hosts of {per_host}")
  return TpuSpec(accelerator=kind.accelerator, topology=topology, chips_per_host=per_host,
                 hosts=chips // per_host)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RenderOptions:
  """What ``sidecar k8s render`` needs; every field but three has a working default."""
  slices: int
  hosts_per_slice: int
  image: str
  trainer_image: str | None = None  # default: ``image``
  trainer_command: tuple[str, ...] = ("python", "-m", "my_pkg.train")
  name: str = "train"
  namespace: str | None = None
  tpu: TpuSpec | None = None
  shm_size: str = "4GiB"
  imports: tuple[str, ...] = ("my_pkg.sidecar_fns",)
  sidecar_cpu: str = "1"
  port: int = 8490
  health_port: int = 8491
  coordinator_port: int = 8476  # the jax.distributed coordinator, in process 0's trainer
  metrics_port: int | None = 8492  # Prometheus /metrics of the sidecar; None: no metrics
  token_secret: str = "sidecar-token"
  peer_token_secret: str = "sidecar-peer-token"
  grace_seconds: int = 300
  # In-place restarts of a pod's trainer the Job allows (pod restartPolicy OnFailure):
  # the native sidecar keeps its arena through them. 0: restartPolicy Never.
  trainer_restarts: int = 4
  # PyTorch ranks per pod (a GPU node's 8): the trainer container runs ``sidecar torchrun
  # --nproc-per-node P -- trainer_command``, a node per pod; 1: the command is the rank.
  procs_per_pod: int = 1
  # One PID namespace for the pod's containers: the trainer's liveness probe can then ask a
  # stalled trainer for its stacks by the pid its sidecar had from the kernel (issue 69).
  share_process_namespace: bool = True

  def __post_init__(self):
    for field in ("slices", "hosts_per_slice", "procs_per_pod"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise errors.InvalidArgumentError(f"{field} must be an integer >= 1, got {value!r}")
    if self.tpu is not None and self.tpu.hosts != self.hosts_per_slice:
      raise errors.InvalidArgumentError(
          f"hosts_per_slice is {self.hosts_per_slice} but TPU topology {self.tpu.topology} "
          f"has {self.tpu.hosts} hosts of {self.tpu.chips_per_host} chips; drop "
          "--hosts-per-slice or make it match")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.name) or len(self.name) > 40:
      raise errors.InvalidArgumentError(
          f"name must be a DNS label of at most 40 characters (lowercase letters, digits, "
          f"'-'), got {self.name!r}")
    try:
      shm.parse_size(self.shm_size)
    except ValueError as e:
      raise errors.InvalidArgumentError(f"shm_size: {e}") from e
    if not isinstance(self.trainer_restarts, int) or self.trainer_restarts < 0:
      raise errors.InvalidArgumentError(
          f"trainer_restarts must be an integer >= 0, got {self.trainer_restarts!r}")
    for field in ("port", "health_port", "coordinator_port", "metrics_port"):
      value = getattr(self, field)
      if field == "metrics_port" and value is None:
        continue
      # A containerPort is 1..65535; a pod cannot pick a free one (0) for its probes.
      if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise errors.InvalidArgumentError(
            f"{field} (--{field.replace('_', '-')}) must be a TCP port in 1..65535, got {value!r}")
    if self.port == self.health_port:
      raise errors.InvalidArgumentError(
          f"port and health_port must differ, both are {self.port}")
    if self.metrics_port is not None and self.metrics_port in (
        self.port, self.health_port, self.coordinator_port):
      raise errors.InvalidArgumentError(
          f"metrics_port {self.metrics_port} is also the port, health_port or coordinator_port "
          f"({self.port}, {self.health_port}, {self.coordinator_port}); pick another")
    if self.coordinator_port in (self.port, self.health_port):
      # Trainer and sidecar share the pod's network namespace.
      raise errors.InvalidArgumentError(
          f"coordinator_port {self.coordinator_port} is also a sidecar port (port "
          f"{self.port}, health_port {self.health_port}); pick another")
    if not self.image:
      raise errors.InvalidArgumentError("image must name the sidecar image, got ''")


def render_jobset(options: RenderOptions) -> dict[str, Any]:
  """The JobSet, as a dict ready for YAML."""
  pod_spec: dict[str, Any] = {
      # OnFailure: a failed trainer restarts in its pod, beside the sidecar and its RAM tier.
      "restartPolicy": "OnFailure" if options.trainer_restarts else "Never",
      "terminationGracePeriodSeconds": options.grace_seconds,
      "automountServiceAccountToken": False,
      # The worker socket (0660) and the token files are this group's: both containers'.
      "securityContext": {"fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
      "initContainers": [_sidecar(options)],
      "containers": [_trainer(options)],
      "volumes": [
          {"name": "sidecar-socket", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
          {"name": "sidecar-tmp", "emptyDir": {"sizeLimit": "256Mi"}},
          {"name": "sidecar-token",
           "secret": {"secretName": options.token_secret, "defaultMode": 0o400}},
          {"name": "sidecar-peer-token",
           "secret": {"secretName": options.peer_token_secret, "defaultMode": 0o400}},
      ],
  }
  if options.share_process_namespace:
    # The sidecar's pids (SO_PEERCRED) are then the probe's: `sidecar stalls --stacks`
    # signals a stalled trainer only in the sidecar's own PID namespace.
    pod_spec["shareProcessNamespace"] = True
  metadata: dict[str, Any] = {"name": options.name}
  if options.namespace:
    metadata["namespace"] = options.namespace
  if options.tpu is not None:
    metadata["annotations"] = {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    pod_spec["nodeSelector"] = {
        "cloud.google.com/gke-tpu-accelerator": options.tpu.accelerator,
        "cloud.google.com/gke-tpu-topology": options.tpu.topology,
    }
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2",
      "kind": "JobSet",
      "metadata": metadata,
      "spec": {
          "failurePolicy": {"maxRestarts": 3},
          "network": {"enableDNSHostnames": True},
          "replicatedJobs": [{
              "name": "slice",
              "replicas": options.slices,
              "template": {"spec": {
                  "completionMode": "Indexed",
                  "parallelism": options.hosts_per_slice,
                  "completions": options.hosts_per_slice,
                  "backoffLimit": options.trainer_restarts,
                  "template": _pod_template(options, pod_spec),
              }},
          }],
      },
  }


def _pod_template(options: RenderOptions, pod_spec: dict[str, Any]) -> dict[str, Any]:
  if options.metrics_port is None:
    return {"spec": pod_spec}
  # The annotations Prometheus's kubernetes_sd "pod" role scrapes by, as most setups do.
  return {"metadata": {"annotations": scrape_annotations(options.metrics_port)},
          "spec": pod_spec}


def scrape_annotations(port: int) -> dict[str, str]:
  return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
          "prometheus.io/path": "/metrics"}


def to_yaml(doc: dict[str, Any], *, command: str | None = None) -> str:
  """``doc`` as YAML, headed by a comment naming the command that made it."""
  header = f"# Rendered by: {command}\n" if command else ""
  return header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def _sidecar(options: RenderOptions) -> dict[str, Any]:
  memory = quantity.format_mebibytes(shm.parse_size(options.shm_size) + ARENA_OVERHEAD)
  probe = {"grpc": {"port": options.health_port}}
  return {
      "name": "sidecar",
      "image": options.image,
      "restartPolicy": "Always",
      "command": ["sidecar", "serve"],
      "ports": [{"name": "grpc", "containerPort": options.port},
                {"name": "health", "containerPort": options.health_port},
                *([] if options.metrics_port is None else
                  [{"name": "metrics", "containerPort": options.metrics_port}])],
      "env": [
          _field_env("SIDECAR_SLICE_ID", "metadata.annotations['jobset.sigs.k8s.io/job-index']"),
          _field_env("SIDECAR_HOST_ID",
                     "metadata.annotations['batch.kubernetes.io/job-completion-index']"),
          {"name": "SIDECAR_PORT", "value": str(options.port)},
          {"name": "SIDECAR_HEALTH_PORT", "value": str(options.health_port)},
          *([] if options.metrics_port is None else
            [{"name": "SIDECAR_METRICS_PORT", "value": str(options.metrics_port)}]),
          {"name": "SIDECAR_SOCKET", "value": f"{SOCKET_DIR}/sidecar.sock"},
          # The emptyDir is mode 2777, and only the pod's containers see it.
          {"name": "SIDECAR_SHARED_SOCKET_DIR", "value": SOCKET_DIR},
          {"name": "SIDECAR_SHM_SIZE", "value": options.shm_size},
          {"name": "SIDECAR_IMPORTS", "value": ",".join(options.imports)},
          {"name": "SIDECAR_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"},
          {"name": "SIDECAR_PEER_TOKEN_FILE", "value": f"{REPLICA_TOKEN_DIR}/token"},
          # The job's sidecars (the JobSet's pods), the only places it sends replicas to.
          *_jobset_env(options),
          # Beyond loopback the sidecar requires the token above.
          {"name": "SIDECAR_LISTEN", "value": "[::]"},
          # Where the checkpoint calls may act: mount the checkpoint volume there.
          {"name": "SIDECAR_CHECKPOINT_ROOTS", "value": CHECKPOINT_ROOT},
          # JAX on the CPU: the trainer owns the accelerator (`sidecar serve` sets it too).
          {"name": "JAX_PLATFORMS", "value": "cpu"},
          # A trainer with no step for this long (or 10x its slowest) is stalled: its
          # container's liveness probe (`sidecar stalls`) fails, and it restarts.
          {"name": "SIDECAR_STALL_TIMEOUT", "value": f"{stall.DEFAULT_FLOOR_S:g}"},
          *_session_quota(options),
      ],
      "resources": {"requests": {"cpu": options.sidecar_cpu, "memory": memory},
                    "limits": {"memory": memory}},
      "startupProbe": dict(probe, periodSeconds=2, failureThreshold=150),
      "readinessProbe": dict(probe, periodSeconds=5),
      "livenessProbe": dict(probe, periodSeconds=10, failureThreshold=6),
      "securityContext": dict(_RESTRICTED, readOnlyRootFilesystem=True),
      "volumeMounts": [_mounts()[0], {"name": "sidecar-tmp", "mountPath": "/tmp"},
                       *_mounts()[1:], {"name": "sidecar-peer-token",
                                        "mountPath": REPLICA_TOKEN_DIR, "readOnly": True}],
  }


def _jobset_env(options: RenderOptions) -> list[dict[str, Any]]:
  """The JobSet's names and sizes, from which a pod finds every sidecar of the job."""
  return [
      _field_env("SIDECAR_JOBSET_NAME", "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"),
      _field_env("SIDECAR_REPLICATED_JOB",
                 "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"),
      _field_env("SIDECAR_NUM_SLICES",
                 "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-replicas']"),
      {"name": "SIDECAR_HOSTS_PER_SLICE", "value": str(options.hosts_per_slice)},
      _field_env("SIDECAR_NAMESPACE", "metadata.namespace"),
  ]


def _session_quota(options: RenderOptions) -> list[dict[str, Any]]:
  """P ranks share the pod's sidecar: each may hold about 1/P of its arena, so that one
  cannot take what the others need (the default 0.9 is one rank's)."""
  share = torchrun.session_share(options.procs_per_pod)
  return [] if share is None else [{"name": "SIDECAR_SESSION_QUOTA", "value": share}]


def _trainer(options: RenderOptions) -> dict[str, Any]:
  container: dict[str, Any] = {
      "name": "trainer",
      "image": options.trainer_image or options.image,
      "command": _trainer_command(options),
      "ports": [{"name": "coordinator", "containerPort": options.coordinator_port}],
      "env": [
          {"name": "SIDECAR_ADDRESS", "value": f"unix://{SOCKET_DIR}/sidecar.sock"},
          # The image's sidecar user: a trainer of another uid trusts its socket.
          {"name": "SIDECAR_SOCKET_UID", "value": IMAGE_UID},
          {"name": "SIDECAR_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"},
          *_jobset_env(options),
          {"name": "SIDECAR_PORT", "value": str(options.port)},
          {"name": "SIDECAR_HEALTH_PORT", "value": str(options.health_port)},
          # For sidecar.jax.initialize(): process id and coordinator.
          _field_env("SIDECAR_SLICE_ID", "metadata.annotations['jobset.sigs.k8s.io/job-index']"),
          _field_env("SIDECAR_HOST_ID",
                     "metadata.annotations['batch.kubernetes.io/job-completion-index']"),
          {"name": "SIDECAR_COORDINATOR_PORT", "value": str(options.coordinator_port)},
          # A stalled trainer's Python stacks, on this signal (core/stacks.py).
          {"name": "SIDECAR_STACKS_SIGNAL", "value": "SIGUSR2"},
      ],
      # Stalled (no step for the sidecar's SIDECAR_STALL_TIMEOUT, docs/elastic.md): its
      # stacks to the log, then the kubelet restarts it in place, as a crash (its sidecar
      # records a stall in the ledger only where it is process 0: docs/elastic.md).
      "livenessProbe": stall_probe(options.port),
      "securityContext": dict(_RESTRICTED),
      "volumeMounts": _mounts(),
  }
  if options.tpu is not None:
    container["resources"] = {"limits": {"google.com/tpu": options.tpu.chips_per_host}}
  return container


def stall_probe(port: int) -> dict[str, Any]:
  """The trainer container's liveness probe: ``sidecar stalls`` asks its pod's sidecar."""
  return {"exec": {"command": ["sidecar", "stalls", f"localhost:{port}", "--stacks"]},
          "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 1}


def _trainer_command(options: RenderOptions) -> list[str]:
  """The trainer's command; with several ranks per pod, under torchrun (a node per pod:
  ``sidecar torchrun`` takes node rank, node count and master from the pod's job)."""
  if options.procs_per_pod == 1:
    return list(options.trainer_command)
  return ["sidecar", "torchrun", "--nproc-per-node", str(options.procs_per_pod), "--",
          *options.trainer_command]


# Both containers: no root, no privilege escalation, no capabilities, the runtime's seccomp.
_RESTRICTED = {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
               "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _field_env(name: str, field_path: str) -> dict[str, Any]:
  return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def _mounts() -> list[dict[str, Any]]:
  return [{"name": "sidecar-socket", "mountPath": SOCKET_DIR},
          {"name": "sidecar-token", "mountPath": TOKEN_DIR, "readOnly": True}]
