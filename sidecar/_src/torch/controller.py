"""``sidecar.torch.connect()``: this rank's controller, from the environment.

The controller core (``controller/controller.py``) with the PyTorch adapter
(``torch/framework.TorchFramework``): it sees every sidecar of the job
(``SIDECAR_HOSTS``, or a JobSet's pods), attaches this rank's own Worker session to its
node's sidecar (``SIDECAR_ADDRESS``) and drives only that sidecar's data path for this
rank. Under several ranks it exchanges values with the others through ``torch.distributed``'s
store, starting the default process group first where the script has not.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch.distributed as dist

from sidecar._src.controller import controller as core
from sidecar._src.controller.framework import Framework
from sidecar._src.core import errors
from sidecar._src.torch import distributed
from sidecar._src.torch.framework import TorchFramework


class Controller(core.Controller):
  """The controller core for PyTorch: its streams' arrays are tensors, its peers the ranks
  of ``torch.distributed``. Made by :func:`connect`; ``sidecar.torch.DataLoader``,
  ``StorageWriter``, ``StorageReader`` and ``Checkpointer`` use it."""

  @staticmethod
  def _default_framework() -> Framework:
    return TorchFramework()


_lock = threading.Lock()
_connected: Controller | None = None


def connect(*, timeout: float = 300.0, **kwargs: Any) -> Controller:
  """This rank's controller, made from the environment once and then shared.

  Under torchrun, ``sidecar launch --torch`` or ``sidecar slurm batch``, every variable
  it needs is set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` for the
  ranks; ``SIDECAR_ADDRESS`` and ``SIDECAR_HOSTS`` for the sidecars). Under plain ``srun``
  or in a pod of the k8s manifests (one rank per pod) the ranks' come from Slurm's or the
  pod's ``SIDECAR_*`` job and are set in ``os.environ`` (``distributed.launcher_env``).
  With several ranks and no process group yet, starts the default one
  (``torch.distributed.init_process_group()``).
  Later calls return the same controller until it is closed; ``kwargs`` (those of
  ``sidecar.jax.Controller``) apply to the first.

  Example::

    ctl = sidecar.torch.connect()
    loader = sidecar.torch.DataLoader("images", batch_size=32, controller=ctl)

  Raises:
    DiscoveryError: a sidecar did not answer within ``timeout`` seconds.
  """
  global _connected
  with _lock:
    if _connected is not None and _connected.state is core.State.OPEN:
      return _connected
    ranks = distributed.ranks()
    if ranks.world_size > 1 and not dist.is_initialized():
      # Under plain srun or in a JobSet's pod, init_process_group's env:// finds torchrun's
      # variables unset: they come from the job's other names (distributed.launcher_env).
      os.environ.update(distributed.launcher_env(os.environ))
      dist.init_process_group()
    try:
      _connected = Controller.from_env(timeout=timeout, **kwargs)
    except errors.SidecarError:
      _connected = None
      raise
    return _connected


def controller_or_connect(controller: core.Controller | None) -> core.Controller:
  """``controller``, or this rank's from :func:`connect`."""
  return connect() if controller is None else controller
