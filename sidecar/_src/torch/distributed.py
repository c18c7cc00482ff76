"""A PyTorch job's ranks, from torchrun's environment, and how they exchange values.

torchrun (torchelastic), ``sidecar launch --torch`` and ``sidecar slurm batch`` give each
rank the same variables, by torchrun's names:

=================================  =======================================================
``RANK``, ``WORLD_SIZE``           this rank and the job's ranks
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` this rank among those of its node, and their count
``GROUP_RANK``                     the node's place in the job
``MASTER_ADDR``, ``MASTER_PORT``   rank 0's store (``init_process_group("gloo"|"nccl")``)
``TORCHELASTIC_RESTART_COUNT``     how often the job was restarted (0 on its first start)
=================================  =======================================================

Where none of them is set they come from the job's other names (:func:`launcher_env`):
under plain ``srun`` (a user's own sbatch script) from Slurm's, ``SLURM_PROCID``,
``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``,
``SLURM_NODEID``, the step's first node (``SLURM_STEP_NODELIST``) as ``MASTER_ADDR`` and,
as PyTorch Lightning chooses it, 15000 + the job id's last four digits as ``MASTER_PORT``;
in a JobSet's pod of the k8s manifests (one rank per pod) from the ``SIDECAR_*`` job that
``sidecar.distributed`` reads (``core/job.py``), the coordinator's address and port (process
0's pod, the trainer's ``coordinator`` port) as ``MASTER_ADDR`` and ``MASTER_PORT``.

:class:`TorchPeers` exchanges values through the default process group's store (the TCPStore at
``MASTER_ADDR:MASTER_PORT``), as ``jax/distributed.JaxPeers`` does through JAX's
key-value store. The sidecars themselves are named by ``SIDECAR_*`` as for JAX
(``SIDECAR_ADDRESS``, ``SIDECAR_HOSTS``: ``core/env.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import time
from collections.abc import Mapping

import torch.distributed as dist

from sidecar._src.controller.peers import LocalPeers, Peers
from sidecar._src.core import env as env_lib, errors, job as job_lib

RANK, WORLD_SIZE = "RANK", "WORLD_SIZE"
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK = "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


@dataclasses.dataclass(frozen=True, slots=True)
class Ranks:
  """Where this process sits in its job, as torchrun's environment says."""
  rank: int = 0
  world_size: int = 1
  local_rank: int = 0
  local_world_size: int = 1
  group_rank: int = 0
  restart_count: int = 0


def _int(environ: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
  text = environ.get(name, "").strip()
  if not text:
    return default
  try:
    value = int(text)
  except ValueError:
    value = minimum - 1
  if value < minimum:
    raise errors.InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {text!r}")
  return value


SLURM_PORT_BASE = 15000  # MASTER_PORT under srun: this + the job id's last 4 digits


def first_node(nodelist: str) -> str:
  """The first host of a Slurm host list: ``gpu[03-05,9],login`` is ``gpu03``."""
  first = re.split(r",(?![^\[]*\])", nodelist.strip(), maxsplit=1)[0]
  return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def _tasks_on_node(per_node: str, node: int) -> int | None:
  """The tasks of node ``node`` from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``)."""
  counts: list[int] = []
  for item in filter(None, per_node.split(",")):
    m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
    if m is None:
      return None
    counts += [int(m.group(1))] * int(m.group(2) or 1)
  return counts[node] if node < len(counts) else None


def launcher_env(environ: Mapping[str, str]) -> dict[str, str]:
  """torchrun's variables from the job's other names, for a process that has none of them
  (empty otherwise: under torchrun, ``sidecar launch --torch`` or ``sidecar slurm batch``,
  or for one process alone): a task of an ``srun`` step, or a JobSet's pod."""
  if RANK in environ or WORLD_SIZE in environ:
    return {}
  if "SLURM_STEP_NUM_TASKS" in environ:
    return slurm_env(environ)
  job = job_lib.job_from_env(environ)
  if job is None:
    return {}
  rank = str(job["process_id"])
  out = {RANK: rank, WORLD_SIZE: str(job["num_processes"]), LOCAL_RANK: "0",
         LOCAL_WORLD_SIZE: "1", GROUP_RANK: rank}
  if job["coordinator_address"]:  # a job of one process has none, and needs no store
    host, _, port = job["coordinator_address"].rpartition(":")
    out.update({MASTER_ADDR: host.strip("[]"), MASTER_PORT: port})
  return out


def slurm_env(environ: Mapping[str, str]) -> dict[str, str]:
  """torchrun's variables from Slurm's, for a task of an ``srun`` step (the batch script
  itself is none: it has no ``SLURM_STEP_NUM_TASKS``)."""
  node = environ.get("SLURM_NODEID", "0")
  out = {RANK: environ.get("SLURM_PROCID", "0"), WORLD_SIZE: environ["SLURM_STEP_NUM_TASKS"],
         LOCAL_RANK: environ.get("SLURM_LOCALID", "0"), GROUP_RANK: node}
  local = _tasks_on_node(environ.get("SLURM_STEP_TASKS_PER_NODE", ""), int(node or 0))
  if local is not None:
    out[LOCAL_WORLD_SIZE] = str(local)
  nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
  if MASTER_ADDR not in environ and nodes:
    out[MASTER_ADDR] = first_node(nodes)
  job = environ.get("SLURM_JOB_ID", "").strip()
  if MASTER_PORT not in environ and job.isdigit():
    out[MASTER_PORT] = str(SLURM_PORT_BASE + int(job[-4:]))
  if RESTART_COUNT not in environ and environ.get("SLURM_RESTART_COUNT"):
    out[RESTART_COUNT] = environ["SLURM_RESTART_COUNT"]
  return out


def ranks(environ: Mapping[str, str] | None = None) -> Ranks:
  """This process's :class:`Ranks`: from ``torch.distributed`` when it is initialized,
  else from torchrun's variables, else from the job's other names (:func:`launcher_env`;
  none: one process)."""
  environ = os.environ if environ is None else environ
  environ = {**environ, **launcher_env(environ)}
  world = _int(environ, WORLD_SIZE, 1, minimum=1)
  rank = _int(environ, RANK, 0)
  if dist.is_available() and dist.is_initialized():
    rank, world = dist.get_rank(), dist.get_world_size()
  if rank >= world:
    raise errors.InvalidArgumentError(f"{RANK} {rank} must be below {WORLD_SIZE} {world}")
  return Ranks(rank=rank, world_size=world, local_rank=_int(environ, LOCAL_RANK, 0),
               local_world_size=_int(environ, LOCAL_WORLD_SIZE, 1, minimum=1),
               group_rank=_int(environ, GROUP_RANK, 0),
               restart_count=_int(environ, RESTART_COUNT, 0))


class TorchPeers(Peers):
  """The ranks of a ``torch.distributed`` job, through its default store."""

  PREFIX = "sidecar/"

  def __init__(self, store: dist.Store | None = None, *, index: int | None = None,
               count: int | None = None):
    if store is None:
      if not (dist.is_available() and dist.is_initialized()):
        raise errors.ClosedError(
            "torch.distributed is not initialized in this process: call "
            "torch.distributed.init_process_group() first (torchrun and sidecar launch "
            "--torch set what it reads)")
      store = dist.distributed_c10d._get_default_store()
      index, count = dist.get_rank(), dist.get_world_size()
    self._store = store
    self.index = 0 if index is None else index
    self.count = 1 if count is None else count

  def publish(self, key: str, value: str) -> None:
    self._store.set(f"{self.PREFIX}{key}/{self.index}", value)

  def read(self, key: str, process: int, *, timeout: float) -> str:
    name = f"{self.PREFIX}{key}/{process}"
    t0 = time.monotonic()
    try:
      self._store.wait([name], datetime.timedelta(seconds=max(timeout, 0.001)))
      return self._store.get(name).decode()
    except (RuntimeError, dist.DistError) as e:  # the store's timeout, or it is gone
      raise errors.DeadlineExceededError(
          f"rank {self.index}: rank {process} gave no answer to {key!r} within "
          f"{time.monotonic() - t0:.3g} s (it died, hangs, or makes other calls than this "
          f"one: every rank must make the same calls in the same order; "
          f"{env_lib.SYNC_TIMEOUT} sets the wait): {str(e)[:300]}") from None


def peers() -> Peers:
  """This job's ranks: :class:`TorchPeers` under ``torch.distributed`` with several
  ranks, else one process.

  Raises:
    ClosedError: ``WORLD_SIZE`` says several ranks but ``torch.distributed`` is not
      initialized (each rank would think itself alone).
  """
  if ranks().world_size == 1:
    return LocalPeers()
  return TorchPeers()
