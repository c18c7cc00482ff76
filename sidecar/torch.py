"""PyTorch through the sidecars: a DataLoader, DCP's storage classes, a Checkpointer.

Example::

  import sidecar.torch, torch.distributed.checkpoint as dcp
  ctl = sidecar.torch.connect()           # torchrun's environment, this rank's sidecar
  loader = sidecar.torch.DataLoader("images", batch_size=32)
  ckpt = sidecar.torch.Checkpointer("/ckpt/run1", max_to_keep=3)
  for step, batch in enumerate(loader):
    ...
    if step % 100 == 0:
      ckpt.save(step, {"model": model.state_dict(), "data": loader.state_dict()})

Importing it loads neither jax nor jaxlib.
"""

from sidecar._src.torch.checkpointer import Checkpointer, SaveHandle
from sidecar._src.torch.controller import Controller, connect
from sidecar._src.torch.distributed import Ranks, TorchPeers, ranks
from sidecar._src.torch.loader import DataLoader
from sidecar._src.torch.storage import StorageReader, StorageWriter

__all__ = ["Checkpointer", "Controller", "DataLoader", "Ranks", "SaveHandle", "StorageReader",
           "StorageWriter", "TorchPeers", "connect", "ranks"]
