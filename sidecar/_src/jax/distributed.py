"""Multi-controller JAX: one trainer process per host under ``jax.distributed``.

Runs in the trainer processes. Two things live here:

- :func:`initialize`: ``jax.distributed.initialize`` from what ``sidecar launch`` or the
  k8s manifests put in the environment (or JAX's own cluster detection).
- :class:`JaxPeers`: how the processes of one job exchange values, through the ``jax.distributed``
  coordination service (its key-value store, with timeouts), as Orbax's multihost
  utilities do. The interface, :class:`Peers`, and the one-process :class:`LocalPeers`
  are the controller core's (``controller/peers.py``): a PyTorch job exchanges them the same way
  through ``torch.distributed``'s store.

The environment :func:`initialize` reads:

==============================  ================================================================
``SIDECAR_COORDINATOR_ADDRESS`` ``host:port`` of the coordinator (process 0). In a JobSet, by
                                default the first pod's stable name:
                                ``{jobset}-{replicated_job}-0-0.{subdomain}:{port}``
``SIDECAR_COORDINATOR_PORT``    the port of that default (8476)
``SIDECAR_NUM_PROCESSES``       processes in the job; in a JobSet, by default
                                ``SIDECAR_NUM_SLICES * SIDECAR_HOSTS_PER_SLICE``
``SIDECAR_PROCESS_ID``          this process; in a JobSet, by default
                                ``SIDECAR_SLICE_ID * SIDECAR_HOSTS_PER_SLICE + SIDECAR_HOST_ID``
``SIDECAR_LOCAL_DEVICES``       CPU runs only: CPU devices of this process
``SIDECAR_SYNC_TIMEOUT``        seconds a process waits for the others at an exchange (300)
==============================  ================================================================
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import jax

from sidecar._src.arena.worker import TrainerProcess
from sidecar._src.controller.peers import LocalPeers, Peers  # also sidecar.distributed's
from sidecar._src.core import env as env_lib, errors
from sidecar._src.core.job import job_from_env

log = logging.getLogger(__name__)
COORDINATOR_ADDRESS = env_lib.COORDINATOR_ADDRESS
NUM_PROCESSES = env_lib.NUM_PROCESSES
PROCESS_ID = env_lib.PROCESS_ID
LOCAL_DEVICES = env_lib.LOCAL_DEVICES
COORDINATOR_PORT = env_lib.COORDINATOR_PORT  # k8s only: sidecar launch gives the address
SYNC_TIMEOUT = env_lib.SYNC_TIMEOUT
DEFAULT_COORDINATOR_PORT = env_lib.DEFAULT_COORDINATOR_PORT


def _client() -> Any:
  """The ``jax.distributed`` coordination client, or None before ``initialize``."""
  try:
    from jax._src import distributed as jax_distributed  # the only home of the client
  except ImportError:  # pragma: no cover - a JAX without it has no multi-controller mode
    return None
  return jax_distributed.global_state.client


def is_initialized() -> bool:
  """Whether ``jax.distributed`` runs in this process."""
  return _client() is not None


def initialize(*, env: Mapping[str, str] | None = None, **kwargs: Any) -> bool:
  """Starts ``jax.distributed`` from the environment; call it before any other JAX call.

  Reads the variables in this module's docstring (set by ``sidecar launch``, ``sidecar
  slurm batch`` and the manifests in ``k8s/``). Where none is set and JAX detects the
  cluster itself (Cloud TPU VMs, GKE TPU pods, a Slurm ``srun`` step, Open MPI), defers to
  ``jax.distributed.initialize()``, with ``SIDECAR_LOCAL_DEVICES`` CPU devices if set.
  Where nothing names a job, does nothing: the script then runs as one process that
  owns every device, unchanged. Idempotent. ``kwargs`` go to
  ``jax.distributed.initialize`` (e.g. ``heartbeat_timeout_seconds``).

  Returns:
    Whether ``jax.distributed`` runs in this process now.

  Example::

    import sidecar
    sidecar.jax.initialize()
    ctl = sidecar.jax.Controller.from_env()   # every sidecar; this process drives its own host

  Raises:
    InvalidArgumentError: the environment names some of the job but not all of it; the
      message names each missing or malformed variable.
  """
  if is_initialized():
    return True
  env = os.environ if env is None else env
  get = lambda name: env.get(name, "").strip()
  args = job_from_env(env)
  if args is None:
    if not _jax_detects_cluster():
      log.info("no jax.distributed job in the environment (%s, %s, %s or a JobSet's): one "
               "process", COORDINATOR_ADDRESS, NUM_PROCESSES, PROCESS_ID)
      return False
    # JAX's own detection (Slurm's srun among others) knows the job, not how many CPU
    # devices each process should have: SIDECAR_LOCAL_DEVICES says, as with our variables.
    if get(LOCAL_DEVICES):
      jax.config.update("jax_num_cpu_devices",
                        env_lib.int_var(env, LOCAL_DEVICES, None, minimum=1))
    return _initialize_detected(kwargs)
  local = args.pop("local_devices", None)
  if local is not None:
    jax.config.update("jax_num_cpu_devices", local)
  if args["num_processes"] == 1:  # sidecar launch --hosts 1: no other process to exchange with
    log.info("%s=1: one process, no jax.distributed", NUM_PROCESSES)
    return False
  jax.distributed.initialize(**args, **kwargs)
  return True


def _initialize_detected(kwargs: Mapping[str, Any]) -> bool:
  """``jax.distributed.initialize`` from JAX's own cluster detection; where that cannot
  complete (a TPU VM's metadata server is not there: a lent or sandboxed TPU host) and
  no variable of ours names a job, this process runs alone, saying so in one line."""
  try:
    jax.distributed.initialize(**kwargs)
  except (OSError, RuntimeError, ValueError) as e:  # requests' ConnectionError is an OSError
    log.warning("JAX detected a cluster but could not complete its detection (%s: %.200s); "
                "no variable names a job (%s, %s, %s): running as one process",
                type(e).__name__, e, COORDINATOR_ADDRESS, NUM_PROCESSES, PROCESS_ID)
    return False
  return True


def _jax_detects_cluster() -> bool:
  try:
    from jax._src import clusters
    return any(c.is_env_present() for c in clusters.ClusterEnv._cluster_types
               if c.__name__ != "K8sCluster")  # it needs a kubernetes client we don't require
  except Exception:  # an internal API; without it, ask for our variables
    return False


class JaxPeers(Peers):
  """The processes of a ``jax.distributed`` job, through its key-value store."""

  PREFIX = "sidecar/"

  def __init__(self, client: Any = None, *, index: int | None = None,
               count: int | None = None):
    self._kv = client if client is not None else _client()
    if self._kv is None:
      raise errors.ClosedError("jax.distributed is not initialized in this process")
    self.index = jax.process_index() if index is None else index
    self.count = jax.process_count() if count is None else count

  def publish(self, key: str, value: str) -> None:
    try:
      self._kv.key_value_set(f"{self.PREFIX}{key}/{self.index}", value)
    except Exception as e:  # jax raises its own runtime errors here
      raise errors.InvalidArgumentError(
          f"process {self.index} could not publish {key!r} (published twice means the "
          f"processes' calls are out of step): {str(e)[:300]}") from None

  def read(self, key: str, process: int, *, timeout: float) -> str:
    t0 = time.monotonic()
    try:
      return self._kv.blocking_key_value_get(f"{self.PREFIX}{key}/{process}",
                                             max(int(timeout * 1000), 1))
    except Exception as e:  # jax raises its own runtime errors here
      waited = time.monotonic() - t0
      raise errors.DeadlineExceededError(
          f"process {self.index}: process {process} gave no answer to {key!r} within "
          f"{waited:.3g} s (it died, hangs, or makes other calls than this one: every "
          f"process must make the same calls in the same order; {SYNC_TIMEOUT} sets the "
          f"wait): {str(e)[:300]}") from None

  def delete(self, key: str) -> None:
    """Forgets this process's answer to ``key`` (the store holds it until then)."""
    try:
      self._kv.key_value_delete(f"{self.PREFIX}{key}/{self.index}")
    except Exception:  # best effort: the store ends with the job
      pass


def peers() -> Peers:
  """This job's processes: :class:`JaxPeers` under ``jax.distributed``, else one."""
  if is_initialized() and jax.process_count() > 1:
    return JaxPeers()
  return LocalPeers()


def local_process() -> TrainerProcess | None:
  """This process's index and devices under ``jax.distributed``, else None.

  A Worker tells its sidecar this on attach. Without ``jax.distributed`` it says
  nothing: asking JAX for devices would start its backends, and in one process
  that owns every device the sidecars' ``--device-ids`` say which are whose.
  """
  if not is_initialized():
    return None
  return TrainerProcess(jax.process_index(), tuple(d.id for d in jax.local_devices()))
