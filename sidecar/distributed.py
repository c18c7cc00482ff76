"""A job's trainer processes (its peers), whatever the framework: what agrees across them.

``Peers`` is what a controller asks of them (how many, which is this one, a barrier, one
value agreed); ``LocalPeers`` is a job of one process. JAX's are ``sidecar.jax.JaxPeers``
(``sidecar.jax.initialize()``), PyTorch's ``sidecar.torch.TorchPeers``.

Example::

  import sidecar.jax
  sidecar.jax.initialize()                 # before any other JAX call
  ctl = sidecar.jax.Controller.from_env()  # every sidecar; this process drives its own host
"""

from sidecar._src.controller.peers import LocalPeers, Peers

__all__ = ["LocalPeers", "Peers"]
