"""Functions the demo's sidecars register
(``sidecar serve --import sidecar._src.tools.demo_functions``)."""

from __future__ import annotations

import os
import socket

import numpy as np

from sidecar._src.user.registry import function


@function
def host_info() -> dict:
  """Where this sidecar runs."""
  return {"hostname": socket.gethostname(), "pid": os.getpid()}


@function
def make_batch(host_id: int, step: int, batch_size: int = 32, image_size: int = 224) -> dict:
  """A deterministic batch of images and labels for ``(host_id, step)``."""
  rng = np.random.default_rng([host_id, step])
  images = rng.integers(0, 256, (batch_size, image_size, image_size, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, (batch_size,), dtype=np.int32)
  return {"images": images, "labels": labels}


@function
def checksum(array: np.ndarray) -> int:
  """The sum of ``array``'s bytes, computed in the sidecar."""
  return int(np.asarray(array).view(np.uint8).sum(dtype=np.uint64))
