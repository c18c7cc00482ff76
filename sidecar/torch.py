"""PyTorch through the sidecars: a DataLoader, DCP's storage classes, a Checkpointer.

Example::

  import sidecar.torch, torch.distributed.checkpoint as dcp
  ctl = sidecar.torch.connect()           # torchrun's environment, this rank's sidecar
  loader = sidecar.torch.DataLoader("images", batch_size=32)
  ckpt = sidecar.torch.Checkpointer(
      "/ckpt/run1", options=sidecar.CheckpointOptions(max_to_keep=3, replicas=1))
  for step, batch in enumerate(loader):
    ...
    if step % 100 == 0:
      ckpt.save(step, {"model": model.state_dict(), "data": loader.state_dict()})

``Checkpointer`` is a class, built on the one core class that ``sidecar.jax.Checkpointer``
names (with DCP's driver and layout): ``isinstance(ckpt, sidecar.torch.Checkpointer)``
holds for what it made, and its ``save`` returns a ``SaveHandle``, JAX's and PyTorch's alike.
``Recovery`` rolls a training loop back to the newest committed step when a step raises, in
the same process (``sidecar.jax.Recovery``'s rule), the DataLoader moved back with it.

Importing it loads neither jax nor jaxlib, and ``torch.distributed.checkpoint`` (2.5 s of
CPU here) only once a checkpoint class is first named: a rank that only reads batches
starts without it.
"""

import importlib
from typing import TYPE_CHECKING, Any

from sidecar._src.core import deprecation as _deprecation
from sidecar._src.torch.controller import Controller, connect
from sidecar._src.torch.distributed import Ranks, TorchPeers, ranks
from sidecar._src.torch.loader import DataLoader
from sidecar._src.torch.recovery import Recovery

if TYPE_CHECKING:
  from sidecar._src.torch.checkpointer import Checkpointer, SaveHandle
  from sidecar._src.torch.storage import StorageReader, StorageWriter

__all__ = ["Checkpointer", "Controller", "DataLoader", "Ranks", "Recovery", "SaveHandle",
           "StorageReader", "StorageWriter", "TorchPeers", "connect", "ranks"]

_WITH_DCP = {"Checkpointer": "checkpointer", "SaveHandle": "checkpointer",
             "StorageReader": "storage", "StorageWriter": "storage"}
# Left for the root in 0.2.0 (both frameworks' options); works until 0.3.0, with a warning.
_MOVED = {"CheckpointOptions": _deprecation.Moved("sidecar.CheckpointOptions")}


def __getattr__(name: str) -> Any:
  if (module := _WITH_DCP.get(name)) is None:
    return _deprecation.resolve(__name__, name, _MOVED)  # AttributeError if never ours
  value = getattr(importlib.import_module(f"sidecar._src.torch.{module}"), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *__all__})
