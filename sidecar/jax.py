"""JAX through the sidecars: the Controller, the Worker, multi-controller JAX.

``sidecar.jax`` stands beside ``sidecar.torch``: each framework's Controller and Worker
are reached there and nowhere else (``sidecar.FeedOptions`` and
``sidecar.CheckpointOptions`` are both frameworks'). Needs the
``jax`` extra: ``pip install 'colocated-sidecar[jax]'`` (JAX, Grain, Orbax, TensorStore).

Example::

  import sidecar.jax
  sidecar.jax.initialize()                  # multi-controller JAX: before any other JAX call
  ctl = sidecar.jax.Controller.from_env()   # every sidecar; this process drives its own host
  feed = ctl.feed("images", sharding=sharding, global_batch_size=256)
  ckpt = ctl.checkpointer("/ckpt/run1", max_to_keep=3)
"""

from sidecar._src.core import extras as _extras

try:
  import jax as _jax  # noqa: F401  (a missing extra fails here, named)
except ImportError as _e:
  raise _extras.missing(_e, "sidecar.jax") from _e

from sidecar._src.jax.controller import Controller
from sidecar._src.jax.distributed import JaxPeers, initialize, is_initialized
from sidecar._src.jax.worker import Worker

__all__ = ["Controller", "JaxPeers", "Worker", "initialize", "is_initialized"]
