"""``sidecar.jax.Worker``: the arena's Worker (``arena/worker.py``) in a JAX trainer process.

It tells its sidecar which process and devices drive the host under ``jax.distributed``
and turns arena views into ``jax.Array``s; every view holds its block, and on the CPU
backend a ``jax.Array`` made of a page-aligned view aliases it (no copy), so the block
goes back only when no array (numpy or jax) reads it any more.
"""

from __future__ import annotations

from typing import Any

import jax

from sidecar._src.arena import worker as worker_lib
from sidecar._src.jax import distributed, transfer


class Worker(worker_lib.Worker):
  """Attaches to the sidecar on this host and maps its arena.

  Example::

    worker = sidecar.jax.Worker("unix:///run/sidecar/sidecar.sock")
    x = worker.to_jax(batch_from_sidecar, sharding=sharding)

  Args:
    address: the sidecar's Unix socket (``unix:///path``); default ``$SIDECAR_ADDRESS``.
    timeout: seconds the sidecar is given to answer anything (the attach, each request,
      a sign of life while a stream waits for its next item); default
      ``$SIDECAR_PEER_TIMEOUT`` or 30. A sidecar silent for longer (hung, SIGSTOPped)
      is lost: what waited on it raises HostLostError, and so does every later request
      of this Worker (make a new one).
  """

  def __init__(self, address: str | None = None, *, timeout: float | None = None,
               token: str | None = None):
    super().__init__(address, timeout=timeout, process=distributed.local_process(), token=token)

  def to_jax(self, tree: Any, *, device: jax.Device | None = None,
             sharding: jax.sharding.Sharding | None = None) -> Any:
    """``jax.device_put`` of every array leaf; views keep their blocks alive."""
    if sharding is None and device is not None:
      return transfer.to_devices(tree, device)
    return jax.device_put(tree, sharding if sharding is not None else device)
