"""A job's trainer processes (its peers), whatever the framework: what agrees across them.

``Peers`` is what a controller asks of them (how many, which is this one, a barrier, one
value agreed); ``LocalPeers`` is a job of one process. JAX's are ``sidecar.jax.JaxPeers``
(``sidecar.jax.initialize()``), PyTorch's ``sidecar.torch.TorchPeers``.

Example::

  import sidecar.jax
  sidecar.jax.initialize()                 # before any other JAX call
  ctl = sidecar.jax.Controller.from_env()  # every sidecar; this process drives its own host
"""

from typing import Any as _Any

from sidecar._src.controller.peers import LocalPeers, Peers
from sidecar._src.core import deprecation as _deprecation

__all__ = ["LocalPeers", "Peers"]

# JAX's names left for sidecar.jax in 0.2.0; each works until 0.3.0, with a warning.
_MOVED = {name: _deprecation.Moved(f"sidecar.jax.{name}")
          for name in ("JaxPeers", "initialize", "is_initialized")}


def __getattr__(name: str) -> _Any:
  return _deprecation.resolve(__name__, name, _MOVED)
