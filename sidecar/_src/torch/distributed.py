"""A PyTorch job's ranks, from torchrun's environment, and how they agree.

torchrun (torchelastic), ``sidecar launch --torch`` and the torch variant of the k8s
manifests give each rank the same variables, by torchrun's names:

=================================  =======================================================
``RANK``, ``WORLD_SIZE``           this rank and the job's ranks
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` this rank among those of its node, and their count
``GROUP_RANK``                     the node's place in the job
``MASTER_ADDR``, ``MASTER_PORT``   rank 0's store (``init_process_group("gloo"|"nccl")``)
``TORCHELASTIC_RESTART_COUNT``     how often the job was restarted (0 on its first start)
=================================  =======================================================

:class:`TorchPeers` agrees through the default process group's store (the TCPStore at
``MASTER_ADDR:MASTER_PORT``), as ``jax/distributed.JaxPeers`` does through JAX's
key-value store. The sidecars themselves are named by ``SIDECAR_*`` as for JAX
(``SIDECAR_ADDRESS``, ``SIDECAR_HOSTS``: ``core/env.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Mapping

import torch.distributed as dist

from sidecar._src.controller.peers import LocalPeers, Peers
from sidecar._src.core import env as env_lib, errors

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


def ranks(environ: Mapping[str, str] | None = None) -> Ranks:
  """This process's :class:`Ranks`: from ``torch.distributed`` when it is initialized,
  else from torchrun's variables (none set: one process)."""
  environ = os.environ if environ is None else environ
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
