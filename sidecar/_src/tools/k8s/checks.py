"""Offline checks of JobSet manifests that carry the sidecar.

Schemas catch malformed fields (:mod:`schemas`); this module checks what they miss:

- every volumeMount names a volume of the pod;
- every gRPC probe port is a ``containerPort`` of its container (and, for the sidecar, its
  health port);
- every memory-backed ``emptyDir`` has a ``sizeLimit``;
- the sidecar is a native sidecar: an ``initContainers`` entry with ``restartPolicy: Always``;
- trainer and sidecar share the socket: the trainer's ``SIDECAR_ADDRESS`` names the sidecar's
  socket, on the same volume in both containers;
- the sidecar's memory limit covers the arena (shm size + 1Gi);
- a sidecar serving metrics declares its metrics port, and the pod's ``prometheus.io/port``
  annotation, where there is one, names that port;
- ``terminationGracePeriodSeconds`` leaves time to flush a checkpoint;
- a pod of several ranks (``torchrun --nproc-per-node P``) gives each its share of the
  arena (``SIDECAR_SESSION_QUOTA``);
- the discovery env matches the JobSet (hosts per slice, ports, DNS hostnames);
- ``sidecar.jax.initialize()`` can resolve jax.distributed from the trainer's env:
  each pod's process id comes from its JobSet annotations, the process count is slices times
  hosts per slice, and the trainer declares the coordinator port.

Example::

  docs = load_documents(open("jobset.yaml").read())
  for finding in check_documents(docs, crd_path="jobsets.yaml"):
    print(finding)
"""

from __future__ import annotations

import pathlib
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from sidecar._src.arena import shm
from sidecar._src.core import errors, options as options_lib
from sidecar._src.tools import torchrun
from sidecar._src.tools.k8s import quantity, schemas
from sidecar._src.tools.k8s.schemas import Finding

# The defaults of `sidecar serve`, for containers that do not set them.
DEFAULT_SOCKET = "/run/sidecar/sidecar.sock"
DEFAULT_PORT = options_lib.DEFAULT_PORT
DEFAULT_HEALTH_PORT = options_lib.DEFAULT_HEALTH_PORT
ARENA_OVERHEAD = 1024 * 2**20
MIN_GRACE_SECONDS = 60
_PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
DEFAULT_COORDINATOR_PORT = 8476
_INITIALIZE = "sidecar.jax.initialize()"
_DISCOVERY_ENV = ("SIDECAR_JOBSET_NAME", "SIDECAR_REPLICATED_JOB", "SIDECAR_NUM_SLICES",
                  "SIDECAR_HOSTS_PER_SLICE")
# What initialize() derives each variable from when it is unset.
_INITIALIZE_ENV = {
    "SIDECAR_COORDINATOR_ADDRESS": ("SIDECAR_JOBSET_NAME", "SIDECAR_REPLICATED_JOB"),
    "SIDECAR_NUM_PROCESSES": ("SIDECAR_NUM_SLICES", "SIDECAR_HOSTS_PER_SLICE"),
    "SIDECAR_PROCESS_ID": ("SIDECAR_SLICE_ID", "SIDECAR_HOST_ID", "SIDECAR_HOSTS_PER_SLICE"),
}
# A pod's identity, as JobSet and the Indexed Job annotate it.
_IDENTITY_REFS = {
    "SIDECAR_SLICE_ID": "metadata.annotations['jobset.sigs.k8s.io/job-index']",
    "SIDECAR_HOST_ID": "metadata.annotations['batch.kubernetes.io/job-completion-index']",
}

__all__ = ["Finding", "check_documents", "check_jobset", "check_pod_spec", "load_documents",
           "raise_for_findings"]


def load_documents(text: str) -> list[dict[str, Any]]:
  """The non-empty YAML (or JSON) documents in ``text``."""
  return [doc for doc in yaml.load_all(text, Loader=schemas.yaml_loader()) if doc]


def check_documents(docs: Iterable[Mapping[str, Any]], *,
                    crd_path: str | pathlib.Path | None = None,
                    kubernetes_versions: Sequence[str] | None = None) -> list[Finding]:
  """Checks every JobSet in ``docs``; other kinds are left alone.

  Args:
    docs: parsed manifests.
    crd_path: the JobSet CRD to validate against; None skips that schema.
    kubernetes_versions: versions to validate pod templates at; default 1.29 and the newest
      kubernetes-validate knows. An empty sequence skips the Pod schema.
  """
  schema = None if crd_path is None else schemas.load_jobset_schema(str(crd_path))
  findings = []
  jobsets = [d for d in docs if isinstance(d, Mapping) and d.get("kind") == "JobSet"]
  if not jobsets:
    return [Finding("manifests", "no JobSet found; pass the rendered JobSet "
                                 "(kubectl kustomize DIR, or sidecar k8s render)")]
  for jobset in jobsets:
    findings += check_jobset(jobset, schema=schema, kubernetes_versions=kubernetes_versions)
  return findings


def check_jobset(jobset: Mapping[str, Any], *, schema: Mapping[str, Any] | None = None,
                 kubernetes_versions: Sequence[str] | None = None) -> list[Finding]:
  """All findings for one JobSet: schemas, then each pod template, then the trainer's env."""
  findings = [] if schema is None else schemas.validate_jobset(jobset, schema)
  name = f"JobSet {(jobset.get('metadata') or {}).get('name', '?')}"
  spec = jobset.get("spec") or {}
  has_sidecar = False
  # JobSet adds a volume for each of these claim templates to every pod template.
  claims = {(t.get("metadata") or {}).get("name", "") for p in spec.get("volumeClaimPolicies") or []
            for t in p.get("templates") or []}
  for i, rjob in enumerate(spec.get("replicatedJobs") or []):
    where = f"{name}: spec.replicatedJobs[{i}]"
    job_spec = ((rjob.get("template") or {}).get("spec")) or {}
    template = job_spec.get("template") or {}
    template_where = f"{where}.template.spec.template"
    if kubernetes_versions is None or kubernetes_versions:
      findings += schemas.validate_pod(template, template_where, kubernetes_versions)
    pod_spec = template.get("spec") or {}
    findings += check_pod_spec(pod_spec, f"{template_where}.spec", extra_volumes=claims)
    findings += _check_metrics(template, template_where)
    findings += _check_trainer_env((jobset.get("metadata") or {}).get("name"), spec, rjob,
                                   job_spec, pod_spec, where)
    has_sidecar = has_sidecar or any(_is_sidecar(c) for _, c in _containers(pod_spec, where))
  if not has_sidecar:
    findings.append(Finding(name, "no replicated job runs the sidecar: add an initContainers "
                                  "entry named 'sidecar' running `sidecar serve` (see "
                                  "k8s/components/sidecar)"))
  return findings


def raise_for_findings(findings: Sequence[Finding]) -> None:
  """Raises InvalidArgumentError listing every finding, if there are any."""
  if findings:
    raise errors.InvalidArgumentError(
        f"{len(findings)} problem(s) in the manifests:\n" + "\n".join(f"  {f}" for f in findings))


def check_pod_spec(spec: Mapping[str, Any], where: str, *,
                   extra_volumes: Iterable[str] = ()) -> list[Finding]:
  """What the Pod schema cannot see, for one pod spec.

  Args:
    spec: the pod spec.
    where: its place, for messages.
    extra_volumes: names of volumes that something else adds (JobSet's volumeClaimPolicies).
  """
  findings = []
  containers = _containers(spec, where)
  volumes = {v.get("name") for v in spec.get("volumes") or []} | set(extra_volumes)
  known = sorted(map(str, volumes))
  for cwhere, c in containers:
    for j, mount in enumerate(c.get("volumeMounts") or []):
      if mount.get("name") not in volumes:
        findings.append(Finding(f"{cwhere}.volumeMounts[{j}]",
                                f"mounts volume {mount.get('name')!r}, which the pod does not "
                                f"define; add it to spec.volumes (has {known})"))
    ports = {p.get("containerPort") for p in c.get("ports") or []}
    for probe in _PROBES:
      grpc_action = (c.get(probe) or {}).get("grpc")
      if grpc_action is not None and grpc_action.get("port") not in ports:
        findings.append(Finding(f"{cwhere}.{probe}.grpc.port",
                                f"port {grpc_action.get('port')!r} is not a containerPort of "
                                f"{c.get('name')!r} (has {sorted(ports, key=str)}); gRPC probes "
                                "need an integer port that the container declares"))
  for i, volume in enumerate(spec.get("volumes") or []):
    empty_dir = volume.get("emptyDir")
    if empty_dir is not None and empty_dir.get("medium") == "Memory" and (
        not empty_dir.get("sizeLimit")):
      findings.append(Finding(f"{where}.volumes[{i}]",
                              f"memory emptyDir {volume.get('name')!r} has no sizeLimit; set "
                              "one (e.g. 16Mi for the socket) so it cannot eat the pod's memory"))
  findings += _check_sidecar(spec, containers, where)
  return findings


def _check_sidecar(spec: Mapping[str, Any], containers: list[tuple[str, dict]],
                   where: str) -> list[Finding]:
  sidecars = [(w, c) for w, c in containers if _is_sidecar(c)]
  trainers = [(w, c) for w, c in containers if _is_trainer(w, c)]
  if not sidecars:
    return [Finding(w, "sets SIDECAR_ADDRESS but the pod has no sidecar; add the "
                       "initContainers entry of k8s/components/sidecar") for w, _ in trainers]
  findings = []
  swhere, sidecar = sidecars[0]
  if ".initContainers[" not in swhere or sidecar.get("restartPolicy") != "Always":
    findings.append(Finding(swhere, "the sidecar must be a native sidecar: an initContainers "
                                    "entry with restartPolicy: Always (Kubernetes >= 1.29)"))
  health = _setting(sidecar, "--health-port", "SIDECAR_HEALTH_PORT", DEFAULT_HEALTH_PORT)
  for probe in _PROBES:
    port = ((sidecar.get(probe) or {}).get("grpc") or {}).get("port")
    if port is None:
      findings.append(Finding(f"{swhere}.{probe}", f"the sidecar needs a gRPC {probe} on its "
                                                   f"health port {health}"))
    elif health is not None and str(port) != str(health):
      findings.append(Finding(f"{swhere}.{probe}.grpc.port",
                              f"probes port {port} but the sidecar serves health on {health} "
                              "(SIDECAR_HEALTH_PORT / --health-port); make them equal"))
  findings += _check_memory(sidecar, swhere)
  grace = spec.get("terminationGracePeriodSeconds", 30)
  if not isinstance(grace, int) or grace < MIN_GRACE_SECONDS:
    findings.append(Finding(f"{where}.terminationGracePeriodSeconds",
                            f"is {grace!r}; give the sidecar at least {MIN_GRACE_SECONDS}s "
                            "to flush a checkpoint on shutdown (the examples use 300)"))
  return findings + _check_socket(sidecar, swhere, trainers, where) + _check_shares(
      sidecar, swhere, trainers)


def _check_shares(sidecar: Mapping[str, Any], swhere: str,
                  trainers: list[tuple[str, dict]]) -> list[Finding]:
  """Ranks that share the sidecar each get a share of its arena: with the default 0.9 one
  rank took 57 of 64 MiB and its neighbour was refused."""
  quota = _setting(sidecar, "--session-quota", "SIDECAR_SESSION_QUOTA", None)
  ranks = max([_nproc_per_node(t) for _, t in trainers] or [1])
  if ranks <= 1 or quota is not None:
    return []
  return [Finding(f"{swhere}.env", f"{ranks} ranks share this sidecar (torchrun "
                  f"--nproc-per-node {ranks}) but it sets no SIDECAR_SESSION_QUOTA: one rank "
                  "may take 0.9 of the arena and its neighbours are refused; set "
                  f"SIDECAR_SESSION_QUOTA={torchrun.session_share(ranks)} (about 1/{ranks})")]


def _nproc_per_node(container: Mapping[str, Any]) -> int:
  """The ranks a trainer container runs: torchrun's ``--nproc-per-node``, else 1."""
  argv = [str(a) for a in list(container.get("command") or []) + list(container.get("args") or [])]
  for i, arg in enumerate(argv):
    name, eq, value = arg.partition("=")
    if name in ("--nproc-per-node", "--nproc_per_node"):
      value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
      return int(value) if value.isdigit() else 1
  return 1


def _check_metrics(template: Mapping[str, Any], where: str) -> list[Finding]:
  """The metrics port is declared, and the scrape annotation points at it."""
  sidecars = [(w, c) for w, c in _containers(template.get("spec") or {}, f"{where}.spec")
              if _is_sidecar(c)]
  if not sidecars:
    return []
  swhere, sidecar = sidecars[0]
  port = _setting(sidecar, "--metrics-port", "SIDECAR_METRICS_PORT", None)
  annotations = (template.get("metadata") or {}).get("annotations") or {}
  scraped = annotations.get("prometheus.io/port")
  findings = []
  declared = {str(p.get("containerPort")) for p in sidecar.get("ports") or []}
  if port is not None and str(port) not in declared:
    findings.append(Finding(f"{swhere}.ports", f"the sidecar serves metrics on {port} "
                            "(SIDECAR_METRICS_PORT / --metrics-port) but does not declare it; "
                            "add a containerPort named metrics"))
  if scraped is not None and str(scraped) != str(port):
    findings.append(Finding(f"{where}.metadata.annotations['prometheus.io/port']",
                            f"is {scraped!r} but the sidecar serves metrics on {port} "
                            "(SIDECAR_METRICS_PORT / --metrics-port); make them equal"))
  return findings


def _check_socket(sidecar: Mapping[str, Any], swhere: str,
                  trainers: list[tuple[str, dict]], where: str) -> list[Finding]:
  """The trainer's SIDECAR_ADDRESS is the sidecar's socket, on a volume both mount."""
  socket = _setting(sidecar, "--socket", "SIDECAR_SOCKET", DEFAULT_SOCKET)
  if socket is None:
    return []
  findings = []
  if not trainers:
    findings.append(Finding(where, "no container sets SIDECAR_ADDRESS; give the trainer "
                                   f"SIDECAR_ADDRESS=unix://{socket}"))
  place = _volume_place(sidecar, socket)
  if place is None:
    findings.append(Finding(swhere, f"socket {socket} is not on a mounted volume; mount a "
                                    "shared emptyDir (medium: Memory) on its directory"))
  for twhere, trainer in trainers:
    address = _env(trainer)["SIDECAR_ADDRESS"] or ""
    path = address.removeprefix("unix://")
    if not address.startswith("unix://") or not path.startswith("/"):
      findings.append(Finding(f"{twhere}.env[SIDECAR_ADDRESS]",
                              f"is {address!r}; the worker attaches over the Unix socket: "
                              f"use unix://{socket}"))
    elif place is not None and _volume_place(trainer, path) != place:
      findings.append(Finding(f"{twhere}.env[SIDECAR_ADDRESS]",
                              f"{address!r} is not the sidecar's socket {socket} on volume "
                              f"{place[0]!r}; mount that volume in {trainer.get('name')!r} "
                              "and point SIDECAR_ADDRESS at the socket in it"))
  return findings


def _check_memory(sidecar: Mapping[str, Any], swhere: str) -> list[Finding]:
  shm_text = _setting(sidecar, "--shm-size", "SIDECAR_SHM_SIZE", None)
  limit_text = ((sidecar.get("resources") or {}).get("limits") or {}).get("memory")
  if limit_text is None:
    return [Finding(f"{swhere}.resources.limits.memory",
                    "the sidecar has no memory limit; the arena is charged to it: set one of "
                    "at least the shm size + 1Gi")]
  if shm_text is None:
    return []
  try:
    need = shm.parse_size(str(shm_text)) + ARENA_OVERHEAD
    limit = quantity.parse_quantity(limit_text)
  except ValueError as e:
    return [Finding(f"{swhere}.resources.limits.memory", str(e))]
  if limit < need:
    return [Finding(f"{swhere}.resources.limits.memory",
                    f"is {limit_text} but the arena ({shm_text}) plus 1Gi needs "
                    f"{quantity.format_mebibytes(need)}; raise the limit or shrink "
                    "SIDECAR_SHM_SIZE")]
  return []


def _check_trainer_env(jobset_name: str | None, jobset_spec: Mapping[str, Any],
                       rjob: Mapping[str, Any], job_spec: Mapping[str, Any],
                       pod_spec: Mapping[str, Any], where: str) -> list[Finding]:
  """The env of each trainer lets discovery and initialize() resolve, as the JobSet says."""
  findings = []
  containers = _containers(pod_spec, f"{where}.template.spec.template.spec")
  sidecar = next((c for _, c in containers if _is_sidecar(c)), None)
  network = jobset_spec.get("network") or {}
  # What the readers assume when a variable is unset, and what the JobSet says it must be.
  defaults = {"SIDECAR_PORT": DEFAULT_PORT, "SIDECAR_HEALTH_PORT": DEFAULT_HEALTH_PORT,
              "SIDECAR_SUBDOMAIN": jobset_name}
  literals = {
      "SIDECAR_HOSTS_PER_SLICE": job_spec.get("completions"),
      "SIDECAR_NUM_SLICES": rjob.get("replicas", 1),
      "SIDECAR_REPLICATED_JOB": rjob.get("name"),
      "SIDECAR_SUBDOMAIN": network.get("subdomain") or jobset_name,
  }
  if sidecar is not None:
    literals["SIDECAR_PORT"] = _setting(sidecar, "--port", "SIDECAR_PORT", DEFAULT_PORT)
    literals["SIDECAR_HEALTH_PORT"] = _setting(sidecar, "--health-port", "SIDECAR_HEALTH_PORT",
                                               DEFAULT_HEALTH_PORT)
  dns_where = f"{where.split(':')[0]}: spec.network.enableDNSHostnames"
  for cwhere, c in containers:
    env = _env(c)
    if not _is_trainer(cwhere, c):
      continue
    readers = _readers(env)
    by_name = "SIDECAR_HOSTS" not in env
    derives_coordinator = "SIDECAR_COORDINATOR_ADDRESS" not in env
    for name, who in readers.items():
      if name not in env:
        findings.append(Finding(f"{cwhere}.env", f"{name} is not set; {' and '.join(who)} "
                                                 f"need{'s' if len(who) == 1 else ''} it "
                                                 "(see k8s/components/sidecar)"))
    for name, want in literals.items():
      if name not in readers and not (by_name or (
          derives_coordinator and name == "SIDECAR_SUBDOMAIN")):
        continue
      have = env[name] if name in env else defaults.get(name)
      if want is not None and have is not None and str(have) != str(want):
        shown = repr(have) if name in env else f"unset (so {str(have)!r})"
        findings.append(Finding(f"{cwhere}.env[{name}]",
                                f"is {shown} but the JobSet or sidecar says {str(want)!r}; "
                                f"set {name}={want}"))
    if network.get("enableDNSHostnames") is False:
      findings += _dns_hostnames_off(dns_where, by_name=by_name,
                                     derives_coordinator=derives_coordinator)
    findings += _check_process_env(c, cwhere, sidecar, rjob, job_spec)
  completions, parallelism = job_spec.get("completions"), job_spec.get("parallelism")
  if completions is not None and parallelism not in (None, completions):
    findings.append(Finding(f"{where}.template.spec.parallelism",
                            f"is {parallelism} but completions is {completions}; every host "
                            "of a slice runs at once, so make them equal"))
  return findings


def _dns_hostnames_off(where: str, *, by_name: bool,
                       derives_coordinator: bool) -> list[Finding]:
  findings = []
  if by_name:
    findings.append(Finding(where, "is false; discovery reaches sidecars by their JobSet "
                                   "hostnames, so set it to true (or give the trainer "
                                   "SIDECAR_HOSTS)"))
  if derives_coordinator:
    findings.append(Finding(where, f"is false; {_INITIALIZE} reaches the coordinator at the "
                                   "JobSet hostname of slice 0 host 0, so set it to true (or "
                                   "give the trainer SIDECAR_COORDINATOR_ADDRESS)"))
  return findings


def _readers(env: Mapping[str, str | None]) -> dict[str, list[str]]:
  """Each variable the trainer must set, with what reads it."""
  readers: dict[str, list[str]] = {}
  if "SIDECAR_HOSTS" not in env:
    for name in _DISCOVERY_ENV:
      readers.setdefault(name, []).append("discovery")
  for name in sorted({n for explicit, derived_from in _INITIALIZE_ENV.items()
                      if explicit not in env for n in derived_from}):
    readers.setdefault(name, []).append(_INITIALIZE)
  return readers


def _check_process_env(trainer: Mapping[str, Any], cwhere: str,
                       sidecar: Mapping[str, Any] | None, rjob: Mapping[str, Any],
                       job_spec: Mapping[str, Any]) -> list[Finding]:
  """Each pod gets its own process id, and process 0's trainer declares the coordinator port."""
  findings = []
  env, refs = _env(trainer), _field_refs(trainer)
  replicas, completions = rjob.get("replicas", 1), job_spec.get("completions")
  processes = replicas * completions if isinstance(completions, int) and isinstance(
      replicas, int) else None
  if env.get("SIDECAR_NUM_PROCESSES") not in (None, str(processes)) and processes is not None:
    findings.append(Finding(f"{cwhere}.env[SIDECAR_NUM_PROCESSES]",
                            f"is {env['SIDECAR_NUM_PROCESSES']!r} but the JobSet runs {processes}"
                            f" pods (replicas {replicas} x completions {completions}); set it "
                            f"to {processes} or drop it"))
  if "SIDECAR_PROCESS_ID" in env:
    if env["SIDECAR_PROCESS_ID"] is not None and processes != 1:
      findings.append(Finding(f"{cwhere}.env[SIDECAR_PROCESS_ID]",
                              f"is {env['SIDECAR_PROCESS_ID']!r} in every pod; drop it, so "
                              f"that {_INITIALIZE} derives each pod's own from "
                              "SIDECAR_SLICE_ID and SIDECAR_HOST_ID"))
  else:
    for name, want in _IDENTITY_REFS.items():
      if name in env and refs.get(name) != want:
        shown = repr(env[name]) if env[name] is not None else f"from {refs.get(name)!r}"
        findings.append(Finding(f"{cwhere}.env[{name}]",
                                f"is {shown}; {_INITIALIZE} derives the process id from it, so "
                                f"take it from the downward API: fieldPath {want}"))
  if "SIDECAR_COORDINATOR_ADDRESS" in env:
    return findings
  port = env.get("SIDECAR_COORDINATOR_PORT", str(DEFAULT_COORDINATOR_PORT))
  declared = {str(p.get("containerPort")) for p in trainer.get("ports") or []}
  if port is not None and port not in declared:
    findings.append(Finding(f"{cwhere}.ports",
                            f"do not declare the coordinator port {port} "
                            "(SIDECAR_COORDINATOR_PORT), where process 0 runs the "
                            "jax.distributed coordinator; add {name: coordinator, "
                            f"containerPort: {port}}}"))
  if sidecar is not None and port is not None:
    taken = {str(_setting(sidecar, "--port", "SIDECAR_PORT", DEFAULT_PORT)),
             str(_setting(sidecar, "--health-port", "SIDECAR_HEALTH_PORT", DEFAULT_HEALTH_PORT))}
    if port in taken:
      findings.append(Finding(f"{cwhere}.env[SIDECAR_COORDINATOR_PORT]",
                              f"is {port}, which the sidecar in the same pod serves on; pick "
                              f"another (the default is {DEFAULT_COORDINATOR_PORT})"))
  return findings


def _containers(spec: Mapping[str, Any], where: str) -> list[tuple[str, dict]]:
  return [(f"{where}.{kind}[{i}]", c) for kind in ("initContainers", "containers")
          for i, c in enumerate(spec.get(kind) or [])]


def _is_sidecar(container: Mapping[str, Any]) -> bool:
  argv = list(container.get("command") or []) + list(container.get("args") or [])
  return container.get("name") == "sidecar" or argv[:2] == ["sidecar", "serve"]


def _is_trainer(where: str, container: Mapping[str, Any]) -> bool:
  return ".containers[" in where and "SIDECAR_ADDRESS" in _env(container)


def _field_refs(container: Mapping[str, Any]) -> dict[str, str | None]:
  """The downward API fieldPath of each env var that has one."""
  return {e.get("name"): ((e["valueFrom"].get("fieldRef") or {}).get("fieldPath"))
          for e in container.get("env") or [] if isinstance(e.get("valueFrom"), Mapping)}


def _env(container: Mapping[str, Any]) -> dict[str, str | None]:
  """Env values by name; None for values that come from ``valueFrom``."""
  return {e.get("name"): (None if "valueFrom" in e else str(e.get("value", "")))
          for e in container.get("env") or []}


def _setting(container: Mapping[str, Any], flag: str, var: str, default: Any) -> Any:
  """A ``sidecar serve`` setting: its flag, else its env var, else ``default``.

  None when the env var comes from ``valueFrom`` (unknown until the pod runs).
  """
  argv = [str(a) for a in list(container.get("command") or []) + list(container.get("args") or [])]
  for i, arg in enumerate(argv):
    if arg == flag and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith(flag + "="):
      return arg.split("=", 1)[1]
  env = _env(container)
  return env[var] if var in env else default


def _volume_place(container: Mapping[str, Any], path: str) -> tuple[str, str] | None:
  """(volume, path inside the volume) of ``path`` in ``container``, or None if unmounted."""
  best = None
  for mount in container.get("volumeMounts") or []:
    root = posixpath.normpath(mount.get("mountPath") or "/")
    if path == root or path.startswith(root.rstrip("/") + "/"):
      if best is None or len(root) > len(best[0]):
        best = (root, mount)
  if best is None:
    return None
  root, mount = best
  inside = posixpath.join(mount.get("subPath") or "", posixpath.relpath(path, root))
  return mount.get("name"), posixpath.normpath(inside)
