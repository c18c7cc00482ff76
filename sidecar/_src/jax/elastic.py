"""``sidecar.elastic.devices``: the JAX devices of the hosts an elastic attempt trains on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def devices(ctl: Any, hosts: Sequence[int]) -> list[jax.Device]:
  """This process's JAX devices that belong to ``hosts``, in device order."""
  owners = ctl.device_hosts
  return [d for d in jax.devices() if owners.get(d.id) in set(hosts)]
