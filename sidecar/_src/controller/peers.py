"""How the trainer processes of one job exchange values: the :class:`Peers` interface.

Every method is called by every process with the same ``key`` (SPMD), so each
exchange is named by a key every process computes alike (``ckpt/3/save/7/prepared``,
say); values are short strings (JSON). A framework supplies the store that moves them:
``jax.distributed``'s key-value store (``jax/distributed.JaxPeers``), ``torch.distributed``'s
``Store`` (the PyTorch adapter). :class:`LocalPeers` is the one-process case, where
an exchange is free.

A store implementation needs two methods::

  class DictPeers(Peers):  # every process in one Python process, as in a unit test
    def __init__(self, store: dict, index: int, count: int):
      self._store, self.index, self.count = store, index, count

    def publish(self, key, value):
      self._store[f"{key}/{self.index}"] = value

    def read(self, key, process, *, timeout):
      deadline = time.monotonic() + timeout
      while f"{key}/{process}" not in self._store:
        if time.monotonic() > deadline:
          raise errors.DeadlineExceededError(f"process {process} gave no {key!r}")
        time.sleep(0.01)
      return self._store[f"{key}/{process}"]
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar._src.core import deprecation, env as env_lib, errors

SYNC_TIMEOUT = env_lib.SYNC_TIMEOUT
DEFAULT_SYNC_TIMEOUT_S = env_lib.DEFAULT_SYNC_TIMEOUT_S


def sync_timeout(env: Mapping[str, str] | None = None) -> float:
  """Seconds to wait for the other processes at an exchange (``SIDECAR_SYNC_TIMEOUT``)."""
  text = (os.environ if env is None else env).get(SYNC_TIMEOUT, "").strip()
  if not text:
    return DEFAULT_SYNC_TIMEOUT_S
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if value <= 0:
    raise errors.InvalidArgumentError(f"{SYNC_TIMEOUT} must be positive seconds, got {text!r}")
  return value


def _timeout(timeout: float | None) -> float:
  return sync_timeout() if timeout is None else timeout


class Peers(abc.ABC):
  """The processes of one job, and how they exchange values. Subclasses move the values.

  Attributes:
    index: this process's index in the job.
    count: the processes in the job.
  """

  index: int = 0
  count: int = 1

  @abc.abstractmethod
  def publish(self, key: str, value: str) -> None:
    """Makes ``value`` this process's answer to ``key``; once per key."""

  @abc.abstractmethod
  def read(self, key: str, process: int, *, timeout: float) -> str:
    """Process ``process``'s answer to ``key``, waiting up to ``timeout`` seconds
    (else DeadlineExceededError)."""

  def all_gather(self, key: str, value: str, *, timeout: float | None = None) -> list[str]:
    """Every process's ``value`` for ``key``, by process index."""
    self.publish(key, value)
    wait = _timeout(timeout)
    return [value if p == self.index else self.read(key, p, timeout=wait)
            for p in range(self.count)]

  def broadcast(self, key: str, value: str | None = None, *,
                timeout: float | None = None) -> str:
    """Process 0's ``value`` for ``key``, in every process (the others pass None)."""
    if self.index == 0:
      if value is None:
        raise errors.InvalidArgumentError(f"process 0 must give the value of {key!r}")
      self.publish(key, value)
      return value
    return self.read(key, 0, timeout=_timeout(timeout))

  def check_same(self, key: str, value: Any, *, what: str, timeout: float | None = None
                 ) -> None:
    """Raises in every process unless every process passes an equal ``value``.

    ``what`` names the value in the error, e.g. ``"the step of the save"``.
    """
    text = json.dumps(value, sort_keys=True, default=repr)
    values = self.all_gather(key, text, timeout=timeout)
    if len(set(values)) == 1:
      return
    decoded = [json.loads(v) for v in values]
    if all(isinstance(d, dict) for d in decoded):  # name only the fields that differ
      fields = sorted({k for d in decoded for k in d
                       if len({json.dumps(e.get(k), sort_keys=True) for e in decoded}) > 1})
      values = [", ".join(f"{k}={json.dumps(d.get(k))}" for k in fields) for d in decoded]
    raise errors.InvalidArgumentError(
        f"the {self.count} processes disagree on {what}: "
        + "; ".join(f"process {p}: {v}" for p, v in enumerate(values))
        + ". Every process must make the same calls with the same arguments, in the same "
        "order")

  def agree(self, key: str, value: Any, *, what: str, timeout: float | None = None) -> None:
    """Deprecated: :meth:`check_same` (an agreement is the sidecars' commit of a step)."""
    deprecation.warn("sidecar.distributed.Peers.agree",
                     deprecation.Moved("sidecar.distributed.Peers.check_same"))
    self.check_same(key, value, what=what, timeout=timeout)


class LocalPeers(Peers):
  """One process: it is alone at each exchange, and nobody else reads what it publishes."""

  def publish(self, key: str, value: str) -> None:
    del key, value

  def read(self, key: str, process: int, *, timeout: float) -> str:
    del timeout
    raise errors.InvalidArgumentError(f"a job of one process has no process {process} to "
                                      f"answer {key!r}")


def hosts_by_process(identities: Sequence[dict[str, Any]]) -> dict[int, int]:
  """``{device id: host id}`` from each process's ``{"host_id", "device_ids"}``.

  Several processes may share one host's sidecar (a node's ranks beside one sidecar,
  each with its own Worker session); no device may belong to two of them.
  """
  out: dict[int, int] = {}
  owner: dict[int, int] = {}
  for p, ident in enumerate(identities):
    host = int(ident["host_id"])
    for d in ident["device_ids"]:
      if int(d) in owner:
        raise errors.InvalidArgumentError(
            f"processes {owner[int(d)]} and {p} both say they own device {d}; give each "
            "process its own devices (SIDECAR_LOCAL_DEVICES, CUDA_VISIBLE_DEVICES)")
      owner[int(d)] = p
      out[int(d)] = host
  return out


def processes_by_host(identities: Sequence[dict[str, Any]]) -> dict[int, list[int]]:
  """``{host id: [process index, ...]}``: which processes drive each host, in order."""
  out: dict[int, list[int]] = {}
  for p, ident in enumerate(identities):
    out.setdefault(int(ident["host_id"]), []).append(p)
  return out
