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
  ckpt = ctl.checkpointer("/ckpt/run1", max_to_keep=3)   # a sidecar.jax.Checkpointer
  handle = ckpt.save(step, state)                         # a sidecar.jax.SaveHandle
  recovery = sidecar.jax.Recovery(ckpt, feed, target=abstract_state)
  step, state = recovery.recover(error, step=step)        # a failed step, rolled back

``Checkpointer`` is the type of what ``ctl.checkpointer`` returns (for ``isinstance`` and
annotations; make one with ``ctl.checkpointer``); ``sidecar.torch.Checkpointer`` is built
on it. ``Recovery`` rolls a training loop back to the newest committed step when a step
raises, in the same process (docs/goodput.md); each ``Rollback`` says what it did.
"""

from sidecar._src.core import extras as _extras

try:
  import jax as _jax  # noqa: F401  (a missing extra fails here, named)
except ImportError as _e:
  raise _extras.missing(_e, "sidecar.jax") from _e

from typing import Any as _Any

from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.controller.checkpoint.save_run import SaveHandle
from sidecar._src.controller.recovery import Recovery, Rollback
from sidecar._src.core import deprecation as _deprecation
from sidecar._src.jax.controller import Controller
from sidecar._src.jax.distributed import JaxPeers, initialize, is_initialized
from sidecar._src.jax.worker import Worker

__all__ = ["Checkpointer", "Controller", "JaxPeers", "Recovery", "Rollback", "SaveHandle",
           "Worker", "initialize", "is_initialized"]

# Left for the root in 0.2.0 (both frameworks' options); works until 0.3.0, with a warning.
_MOVED = {"FeedOptions": _deprecation.Moved("sidecar.FeedOptions")}


def __getattr__(name: str) -> _Any:
  return _deprecation.resolve(__name__, name, _MOVED)
