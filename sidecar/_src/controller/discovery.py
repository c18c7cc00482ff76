"""Finds every sidecar of a job from the environment and waits until each answers.

Runs in the controller process. Four ways to name the sidecars, checked in this order:

1. ``SIDECAR_HOSTS``: an explicit comma-separated list in host order (slice-major), each
   entry ``HOST``, ``HOST:PORT`` or ``HOST:PORT:HEALTH_PORT`` (IPv6 in brackets:
   ``[::1]:8480:8481``), or ``unix:PATH`` for a sidecar of this machine serving on a Unix
   socket (its health answers there too). Useful off Kubernetes, e.g.
   ``SIDECAR_HOSTS=$TPU_WORKER_HOSTNAMES`` on TPU VMs, or for sidecars started by hand.
   An entry that can never answer (a path without ``unix:``, a port out of range, a host
   name that does not resolve) is refused at once (``address.parse_entry``,
   ``check_resolvable``), not waited for; so is one of a cluster file (2).
2. ``SIDECAR_CLUSTER_FILE``: a service's ``cluster.env`` (``sidecar slurm service``), with
   the sidecars' addresses, its token file and its Slurm job, which must still run.
3. Inside a Slurm job whose rendezvous directory exists (``sidecar slurm batch`` makes it,
   see core/rendezvous.py): the entries its sidecars wrote there, once all have, and its
   token file. A task of ``srun`` then also finds its own sidecar there (:func:`own_address`).
4. A JobSet: the pod hostnames JobSet gives with ``network.enableDNSHostnames``,
   ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>``, for every slice (job index)
   and host (pod completion index). The manifests in ``k8s/`` set these in the trainer's env:

   ==========================  ==========================================================
   ``SIDECAR_JOBSET_NAME``     JobSet name (downward API: the ``jobset.sigs.k8s.io/
                               jobset-name`` annotation)
   ``SIDECAR_REPLICATED_JOB``  replicated job name (``jobset.sigs.k8s.io/replicatedjob-name``)
   ``SIDECAR_NUM_SLICES``      slices = replicated job replicas
                               (``jobset.sigs.k8s.io/replicatedjob-replicas``)
   ``SIDECAR_HOSTS_PER_SLICE`` hosts per slice = the Job's completions (a literal)
   ``SIDECAR_SUBDOMAIN``       optional; defaults to the JobSet name, as JobSet does
   ``SIDECAR_NAMESPACE``       optional; only used by a ``SIDECAR_HOST_TEMPLATE``
   ``SIDECAR_HOST_TEMPLATE``   optional; a ``str.format`` template for each host name with
                               fields ``jobset``, ``replicated_job``, ``slice``, ``host``,
                               ``index`` (slice-major), ``subdomain`` and ``namespace``.
                               Default ``{jobset}-{replicated_job}-{slice}-{host}.{subdomain}``
   ==========================  ==========================================================

Either way ``SIDECAR_PORT`` (default 8490) is every sidecar's gRPC port and
``SIDECAR_HEALTH_PORT`` (default 8491) its plaintext ``grpc.health.v1`` port, unless an
entry of ``SIDECAR_HOSTS`` names its own.

Example::

  addresses = discover(timeout=600)  # ["train-slice-0-0.train:8490", ...]
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar._src.core import (
  address as address_lib,
  env as env_lib,
  errors,
  options as options_lib,
  rendezvous,
)

DEFAULT_PORT = options_lib.DEFAULT_PORT
DEFAULT_HEALTH_PORT = options_lib.DEFAULT_HEALTH_PORT
DEFAULT_HOST_TEMPLATE = "{jobset}-{replicated_job}-{slice}-{host}.{subdomain}"

# Short reconnect backoff: a sidecar whose pod is not scheduled yet must be seen within a
# second or two of answering, not after gRPC's default backoff of up to two minutes.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
    # Sidecars are reached directly inside the cluster, never through an http_proxy.
    ("grpc.enable_http_proxy", 0),
)
_PER_TRY_TIMEOUT = 5.0
_POLL_INTERVAL = 0.25
FIRST_LOG_S, LOG_EVERY_S = 1.0, 5.0  # when a wait says what it waits for, and again
# How long a sidecar of this machine (loopback, unix:) may refuse connections (nothing
# listens, no socket file) before the wait gives up on it: one starting beside the
# trainer listens within this; a wrong port or path never will.
REFUSED_GRACE_S = 5.0
log = logging.getLogger(__name__)
ADVICE_HOSTS = (
    "Check that each SIDECAR_HOSTS entry is where a sidecar serves: unix:PATH, or "
    "HOST:PORT:HEALTH_PORT (an entry without HEALTH_PORT is checked on SIDECAR_HEALTH_PORT, "
    f"default {DEFAULT_HEALTH_PORT}); `sidecar local` prints the SIDECAR_HOSTS line to paste, "
    "`sidecar status ADDRESS` asks one sidecar. Raise the timeout if they are still starting.")
ADVICE_JOBSET = (
    "Check that their pods are running (kubectl get pods -l "
    "jobset.sigs.k8s.io/jobset-name=NAME), that the health port matches "
    "SIDECAR_HEALTH_PORT, and raise the timeout if pods are still being scheduled.")
JOBSET_VARS = (env_lib.JOBSET_NAME, env_lib.REPLICATED_JOB, env_lib.NUM_SLICES,
                env_lib.HOSTS_PER_SLICE)


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
  """Where one sidecar listens: ``host`` with its ports, or a ``unix:PATH`` (ports 0)."""
  slice_id: int
  host_id: int
  host: str
  port: int
  health_port: int

  @property
  def address(self) -> str:
    """The gRPC address, ``host:port`` or ``unix:PATH``."""
    if address_lib.is_unix(self.host):
      return self.host
    return str(address_lib.Address(host=self.host, port=self.port))

  @property
  def health_address(self) -> str:
    """The plaintext health address, ``host:health_port``, or the ``unix:PATH`` itself."""
    if address_lib.is_unix(self.host):
      return self.host
    return str(address_lib.Address(host=self.host, port=self.health_port))

  def __str__(self) -> str:
    return f"slice {self.slice_id} host {self.host_id} ({self.health_address})"


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
  """The sidecars of a job, and the token file that guards them where the place they were
  found names one (a cluster file, a Slurm job's rendezvous directory)."""
  addresses: tuple[str, ...]
  token_file: str | None = None

  def controller_kwargs(self, kwargs: dict, *, env_token_first: bool) -> dict:
    """A Controller's ``kwargs`` with the token file's token where they give none (nor,
    with ``env_token_first``, ``$SIDECAR_TOKEN``)."""
    if (self.token_file and kwargs.get("token") is None
        and not (env_token_first and env_lib.get(env_lib.TOKEN))):
      kwargs = {**kwargs, "token": rendezvous.read_token_file(self.token_file)}
    return kwargs


def find(*, timeout: float = 300.0, env: Mapping[str, str] | None = None) -> Found:
  """Like :func:`discover`, with the token file of a cluster file or Slurm job."""
  env = os.environ if env is None else env
  if not env.get(env_lib.HOSTS, "").strip():
    if env_lib.get(env_lib.CLUSTER_FILE, environ=env):
      return from_cluster_file(str(env_lib.get(env_lib.CLUSTER_FILE, environ=env)),
                               timeout=timeout)
    directory = rendezvous.job_dir(env)
    if directory and os.path.exists(os.path.join(directory, rendezvous.JOB_FILE)):
      found = _from_job_dir(directory, timeout=timeout)
      wait_until_serving(found, timeout=timeout, advice=(
          f"See the sidecars' logs in {os.path.join(directory, rendezvous.LOGS_DIR)}."))
      token = os.path.join(directory, rendezvous.TOKEN_FILE)
      return Found(tuple(e.address for e in found), token if os.path.exists(token) else None)
  found = endpoints_from_env(env)
  listed = bool(env.get(env_lib.HOSTS, "").strip())
  if listed:
    check_resolvable(found, what=env_lib.HOSTS)
  wait_until_serving(found, timeout=timeout, advice=ADVICE_HOSTS if listed else ADVICE_JOBSET)
  return Found(tuple(e.address for e in found))


def from_cluster_file(path: str, *, timeout: float = 60.0) -> Found:
  """The sidecars a service's ``cluster.env`` names, once every one serves.

  Raises:
    InvalidArgumentError: the file is missing or malformed, or its token file is
      unreadable or readable by others.
    DiscoveryError: the service's Slurm job has ended (the message names it), or a
      sidecar does not answer within ``timeout``.
  """
  cluster = rendezvous.ClusterFile.read(path)
  gone = _slurm_job_gone(cluster.job_id)
  if gone:
    raise errors.DiscoveryError(
        f"cluster file {path} names Slurm job {cluster.job_id} (service {cluster.name!r}), "
        f"which is gone ({gone}); start the service again: sidecar slurm service --name "
        f"{cluster.name}")
  rendezvous.read_token_file(cluster.token_file)  # refused early, naming it
  found = _from_host_list({env_lib.HOSTS: ",".join(cluster.hosts)}, DEFAULT_PORT,
                          DEFAULT_HEALTH_PORT)
  check_resolvable(found, what=f"cluster file {path}")
  try:
    wait_until_serving(found, timeout=timeout, advice=(
        f"Check the service's sidecars: sidecar status {' '.join(cluster.hosts)}"))
  except errors.DiscoveryError as e:
    raise errors.DiscoveryError(
        f"the sidecars of service {cluster.name!r} (Slurm job {cluster.job_id}, cluster file "
        f"{path}) do not all serve: {e}") from None
  return Found(tuple(e.address for e in found), cluster.token_file)


_LIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING",
                "SUSPENDED", "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT"}


def _slurm_job_gone(job_id: str) -> str | None:
  """Why Slurm job ``job_id`` no longer runs, or None if it does (or Slurm can't tell)."""
  if not shutil.which("squeue"):
    return None  # off the cluster: the health checks tell
  try:
    done = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"],
                          capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return None
  states = set(done.stdout.split())
  if done.returncode and "Invalid job id" in done.stderr or (not done.returncode and not states):
    return "squeue no longer lists it"
  if done.returncode:
    return None  # the controller unreachable, say: the health checks tell
  if states and not states & _LIVE_STATES:
    return f"its state is {', '.join(sorted(states))}"
  return None


def _from_job_dir(directory: str, *, timeout: float) -> tuple[Endpoint, ...]:
  """The sidecars of a Slurm job's rendezvous directory, once every one wrote its entry."""
  job = rendezvous.read_json(os.path.join(directory, rendezvous.JOB_FILE))
  expected = int(job["num_hosts"])
  deadline = time.monotonic() + timeout
  while True:
    entries = rendezvous.read_hosts(directory)
    if len(entries) >= expected:
      return tuple(Endpoint(e.slice_id, e.host_id, e.address, e.port, e.health_port)
                   for e in entries)
    if time.monotonic() >= deadline:
      have = sorted(e.host_id for e in entries)
      raise errors.DiscoveryError(
          f"Slurm job {job.get('job_id')}: {len(entries)} of {expected} sidecars wrote their "
          f"entry in {directory} within {timeout:g} s (hosts {have}); see the logs in "
          f"{os.path.join(directory, rendezvous.LOGS_DIR)}")
    time.sleep(_POLL_INTERVAL)


def own_address(env: Mapping[str, str] | None = None) -> str | None:
  """``unix://PATH`` of this Slurm task's own sidecar, from the rendezvous directory;
  None outside a Slurm step or where the job has none.

  Tasks and sidecars pair up by node: the node's tasks, by ``SLURM_LOCALID``, go in
  equal shares to its sidecars, by host id.
  """
  env = os.environ if env is None else env
  directory = rendezvous.job_dir(env)
  node, local = env.get("SLURMD_NODENAME", "").strip(), env.get("SLURM_LOCALID", "").strip()
  if not directory or not node or not local.isdigit():
    return None
  try:
    job = rendezvous.read_json(os.path.join(directory, rendezvous.JOB_FILE))
  except OSError:
    return None
  mine = [e for e in rendezvous.read_hosts(directory) if e.node == node]
  share = max(int(job["tasks_per_node"]) // max(int(job["hosts_per_node"]), 1), 1)
  index = int(local) // share
  return f"unix://{mine[index].socket}" if index < len(mine) else None


def discover(*, timeout: float = 300.0, env: Mapping[str, str] | None = None) -> list[str]:
  """Returns the gRPC addresses of all sidecars, in host order, once every one is serving.

  Args:
    timeout: seconds to wait for the last sidecar to answer its health check.
    env: the environment to read (default ``os.environ``); see the module docstring.

  Returns:
    ``host:port`` for each sidecar: slice 0 hosts 0..N-1, then slice 1, and so on.

  Raises:
    InvalidArgumentError: the environment names no sidecars or holds a malformed value.
    DiscoveryError: some sidecars did not answer SERVING within ``timeout``; the message
      lists each of them with its last error.
  """
  return list(find(timeout=timeout, env=env).addresses)


def endpoints_from_env(env: Mapping[str, str] | None = None) -> tuple[Endpoint, ...]:
  """Computes every sidecar's endpoint from ``env``, without contacting any of them."""
  env = os.environ if env is None else env
  port = env_lib.int_var(env, env_lib.PORT, DEFAULT_PORT, minimum=1, maximum=65535)
  health_port = env_lib.int_var(env, env_lib.HEALTH_PORT, DEFAULT_HEALTH_PORT, minimum=1,
                         maximum=65535)
  if env.get(env_lib.HOSTS, "").strip():
    return _from_host_list(env, port, health_port)
  missing = [name for name in JOBSET_VARS if not env.get(name, "").strip()]
  if missing:
    raise errors.InvalidArgumentError(
        f"cannot find the sidecars: {', '.join(missing)} not set. Set SIDECAR_HOSTS to a "
        "comma-separated list of HOST[:PORT[:HEALTH_PORT]] or unix:PATH, SIDECAR_CLUSTER_FILE "
        "to a service's cluster.env, run in a Slurm job of `sidecar slurm batch`, or in a "
        f"JobSet pod whose env sets {', '.join(JOBSET_VARS)} (the manifests in k8s/ do; see "
        "docs/kubernetes.md).")
  return _from_jobset(env, port, health_port)


def wait_until_serving(endpoints: Sequence[Endpoint], *, timeout: float,
                       advice: str = ADVICE_HOSTS) -> None:
  """Polls each endpoint's ``grpc.health.v1`` Check until all say SERVING.

  Logs what it waits for after ``FIRST_LOG_S``, then every ``LOG_EVERY_S``. A sidecar of
  this machine that refuses connections for ``REFUSED_GRACE_S`` (nothing listens on the
  port, no socket at the path) ends the wait at once: nothing will answer there.

  Args:
    advice: what the error tells the user to check, fit for where the sidecars run.

  Raises:
    DiscoveryError: when ``timeout`` passes first, or a sidecar of this machine refuses,
      listing every endpoint still not serving and the last error it gave.
  """
  if timeout < 0:
    raise errors.InvalidArgumentError(f"timeout must be >= 0 seconds, got {timeout!r}")
  start = time.monotonic()
  deadline, logged = start + timeout, start + FIRST_LOG_S - LOG_EVERY_S
  channels = {e: grpc.insecure_channel(e.health_address, options=_CHANNEL_OPTIONS)
              for e in endpoints}
  last_error = {e: "no answer yet" for e in endpoints}
  refused_since: dict[Endpoint, float] = {}
  pending = list(dict.fromkeys(endpoints))
  try:
    while pending:
      pending = _check_once(pending, channels, last_error, deadline)
      now = time.monotonic()
      for e in pending:
        if (why := _refused(e)) is None:
          refused_since.pop(e, None)
        else:
          last_error[e] = why
          refused_since.setdefault(e, now)
      gone = [e for e in pending if now - refused_since.get(e, now) >= REFUSED_GRACE_S]
      if gone or (pending and now >= deadline):
        raise errors.DiscoveryError(_failure_message(
            pending, len(endpoints), timeout, last_error, advice,
            waited=None if not gone else now - start))
      if pending and now - logged >= LOG_EVERY_S:
        logged = now
        log.warning("waiting for %d of %d sidecars to answer SERVING (%.0f of %.0f s): %s",
                    len(pending), len(endpoints), now - start, timeout,
                    "; ".join(f"{e}: {last_error[e]}" for e in pending))
      if pending:
        time.sleep(min(_POLL_INTERVAL, deadline - now))
  finally:
    for channel in channels.values():
      channel.close()


def _check_once(pending: list[Endpoint], channels: Mapping[Endpoint, grpc.Channel],
                last_error: dict[Endpoint, str], deadline: float) -> list[Endpoint]:
  """Sends one Check to each pending endpoint at once; returns those not yet serving."""
  per_try = max(min(_PER_TRY_TIMEOUT, deadline - time.monotonic()), 0.05)
  request = health_pb2.HealthCheckRequest(service="")
  futures = {e: health_pb2_grpc.HealthStub(channels[e]).Check.future(request, timeout=per_try)
             for e in pending}
  still = []
  for endpoint, future in futures.items():
    try:
      status = future.result().status
    except grpc.RpcError as e:
      # A socket this process may not open will not open later: said now, not a timeout.
      address_lib.check_access(endpoint.health_address)
      last_error[endpoint] = f"{e.code().name}: {e.details()}"
      still.append(endpoint)
      continue
    if status != health_pb2.HealthCheckResponse.SERVING:
      last_error[endpoint] = (
          f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
      still.append(endpoint)
  return still


def _refused(e: Endpoint) -> str | None:
  """Why nothing can answer at ``e``, a sidecar of this machine (a Unix socket or a
  loopback port): no socket file, or the connection refused; None if it may yet answer
  (it accepts, or it is another machine's)."""
  if address_lib.is_unix(e.host):
    path = address_lib.parse(e.host).path
    if not os.path.exists(path):
      return f"no socket at {path}"
    family, target = socket.AF_UNIX, path
  else:
    try:
      local = e.host == "localhost" or ipaddress.ip_address(e.host).is_loopback
    except ValueError:
      local = False
    if not local:
      return None
    family = socket.AF_INET6 if ":" in e.host else socket.AF_INET
    target = (e.host, e.health_port)  # type: ignore[assignment]
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.settimeout(1.0)
    try:
      s.connect(target)
    except (ConnectionRefusedError, FileNotFoundError) as err:
      return f"nothing listens at {e.health_address} ({err.strerror})"
    except OSError:
      return None  # busy, or slow: the health check tells
  return None


def _failure_message(pending: Sequence[Endpoint], total: int, timeout: float,
                     last_error: Mapping[Endpoint, str], advice: str, *,
                     waited: float | None = None) -> str:
  if waited is None:
    lines = [f"{len(pending)} of {total} sidecars did not answer SERVING within {timeout:g}s:"]
  else:
    lines = [f"{len(pending)} of {total} sidecars did not answer SERVING, and nothing listens "
             f"where one of this machine should (after {waited:.1f} s of {timeout:g} s):"]
  lines += [f"  {e}: {last_error[e]}" for e in pending]
  lines.append(advice)
  return "\n".join(lines)


def _from_jobset(env: Mapping[str, str], port: int, health_port: int) -> tuple[Endpoint, ...]:
  slices = env_lib.int_var(env, env_lib.NUM_SLICES, None, minimum=1)
  hosts = env_lib.int_var(env, env_lib.HOSTS_PER_SLICE, None, minimum=1)
  jobset = env[env_lib.JOBSET_NAME].strip()
  fields = {
      "jobset": jobset,
      "replicated_job": env[env_lib.REPLICATED_JOB].strip(),
      "subdomain": env.get(env_lib.SUBDOMAIN, "").strip() or jobset,
      "namespace": env.get(env_lib.NAMESPACE, "").strip() or "default",
  }
  template = env.get(env_lib.HOST_TEMPLATE, "").strip() or DEFAULT_HOST_TEMPLATE
  found = []
  for slice_id in range(slices):
    for host_id in range(hosts):
      try:
        name = template.format(slice=slice_id, host=host_id, index=slice_id * hosts + host_id,
                               **fields)
      except (KeyError, IndexError, ValueError) as e:
        raise errors.InvalidArgumentError(
            f"SIDECAR_HOST_TEMPLATE {template!r} is not a valid template ({e!r}); use the "
            "fields {jobset} {replicated_job} {slice} {host} {index} {subdomain} "
            "{namespace}") from e
      found.append(Endpoint(slice_id, host_id, name, port, health_port))
  return tuple(found)


def _from_host_list(env: Mapping[str, str], port: int,
                    health_port: int) -> tuple[Endpoint, ...]:
  entries = [s.strip() for s in env[env_lib.HOSTS].split(",")]
  if any(not s for s in entries):
    raise errors.InvalidArgumentError(
        f"SIDECAR_HOSTS has an empty entry: {env[env_lib.HOSTS]!r}; list hosts separated "
        "by single commas")
  per_slice = len(entries)
  if env.get(env_lib.HOSTS_PER_SLICE, "").strip():
    per_slice = env_lib.int_var(env, env_lib.HOSTS_PER_SLICE, None, minimum=1)
    if len(entries) % per_slice:
      raise errors.InvalidArgumentError(
          f"SIDECAR_HOSTS lists {len(entries)} hosts, not a multiple of "
          f"SIDECAR_HOSTS_PER_SLICE={per_slice}; list every host of every slice")
  found = []
  for index, entry in enumerate(entries):
    at, health = address_lib.parse_entry(entry, port=port, health_port=health_port)
    found.append(Endpoint(index // per_slice, index % per_slice, at.target if at.is_unix
                          else at.host, at.port, health))
  return tuple(found)


def check_resolvable(endpoints: Sequence[Endpoint], *, what: str) -> None:
  """Refuses at once endpoints named by the user (SIDECAR_HOSTS, a cluster file) whose host
  name does not exist: no wait makes them answer. A JobSet's names are not checked: they
  resolve only once their pods run."""
  address_lib.check_resolvable(
      [address_lib.Address(host=e.host, port=e.port) for e in endpoints
       if not address_lib.is_unix(e.host)], what=what)
