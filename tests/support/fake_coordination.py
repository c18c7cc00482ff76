"""An in-memory fake of jax's coordination client (its key-value store), for Peers tests."""

import threading


class FakeCoordinationClient:
  """The part of jax's DistributedRuntimeClient that JaxPeers uses, in memory."""

  def __init__(self):
    self._values: dict[str, str] = {}
    self._cond = threading.Condition()

  def key_value_set(self, key: str, value: str) -> None:
    with self._cond:
      if key in self._values:
        raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
      self._values[key] = value
      self._cond.notify_all()

  def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
    with self._cond:
      if not self._cond.wait_for(lambda: key in self._values, timeout_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self._values[key]

  def key_value_delete(self, key: str) -> None:
    with self._cond:
      self._values.pop(key, None)
