"""Multi-controller JAX: one trainer process per host under ``jax.distributed``.

Example::

  import sidecar
  sidecar.distributed.initialize()         # before any other JAX call
  ctl = sidecar.Controller.from_env()      # every sidecar; this process drives its own host
"""

from sidecar._src.jax.distributed import JaxPeers, LocalPeers, Peers, initialize, is_initialized

__all__ = ["JaxPeers", "LocalPeers", "Peers", "initialize", "is_initialized"]
