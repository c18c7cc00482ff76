"""Elastic training: when a host is lost, train on, on the hosts that remain.

Example::

  @sidecar.elastic.retry(ctl, min_hosts=2)
  def train(hosts):
    mesh = Mesh(np.array(sidecar.elastic.devices(ctl, hosts)), ("data",))
    ...                     # restore the latest step, reopen the feed from its position

  train()
  print(train.events)

Importing it loads no JAX: ``devices`` (JAX's devices of the hosts) imports it when first
named, so ``from sidecar import *`` stays framework-free.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING, Any as _Any

from sidecar._src.controller.elastic import Event, Regrow, Retry, phase, retry

if _TYPE_CHECKING:
  from sidecar._src.jax.elastic import devices

__all__ = ["Event", "Regrow", "Retry", "devices", "phase", "retry"]


def __getattr__(name: str) -> _Any:
  if name != "devices":
    raise AttributeError(f"module 'sidecar.elastic' has no attribute {name!r}")
  try:
    value = _importlib.import_module("sidecar._src.jax.elastic").devices
  except ImportError as e:
    from sidecar._src.core import extras
    raise extras.missing(e, "sidecar.elastic.devices") from e
  globals()[name] = value  # the next access is a plain attribute
  return value


def __dir__() -> list[str]:
  return sorted({*(n for n in globals() if not n.startswith("_")), *__all__})
