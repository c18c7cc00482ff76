"""Functions the test sidecars register (``--import tests.support.sidecar_fns``)."""

import os
import signal
import threading
import time

import numpy as np

import sidecar

_log: list = []
_log_lock = threading.Lock()
_barriers: dict[int, threading.Barrier] = {}


@sidecar.function
def echo(x):
  return x


@sidecar.function(name="add")
def add_numbers(a, b=0):
  return a + b


@sidecar.function
def fail(message: str):
  raise ValueError(message)


@sidecar.function
def sleep(seconds: float) -> float:
  time.sleep(seconds)
  return seconds


@sidecar.function
def record(tag, delay: float = 0.0):
  time.sleep(delay)
  with _log_lock:
    _log.append(tag)
  return tag


@sidecar.function
def take_log():
  with _log_lock:
    out = list(_log)
    _log.clear()
  return out


@sidecar.function
def rendezvous(parties: int, timeout: float = 10.0) -> bool:
  """Returns only when ``parties`` calls are inside at once: proves concurrency."""
  with _log_lock:
    barrier = _barriers.setdefault(parties, threading.Barrier(parties))
  barrier.wait(timeout)
  return True


_gates: dict[str, threading.Event] = {}
_waiting: dict[str, int] = {}


@sidecar.function
def wait_gate(name: str, timeout: float = 30.0) -> bool:
  """Blocks until the test opens gate ``name`` (``open_gate``, in-process sidecars only)."""
  with _log_lock:
    gate = _gates.setdefault(name, threading.Event())
    _waiting[name] = _waiting.get(name, 0) + 1
  try:
    return gate.wait(timeout)
  finally:
    with _log_lock:
      _waiting[name] -= 1


def waiting(name: str) -> int:
  """How many calls wait at gate ``name``."""
  with _log_lock:
    return _waiting.get(name, 0)


def open_gate(name: str) -> None:
  with _log_lock:
    _gates.setdefault(name, threading.Event()).set()


@sidecar.function
def full(n: int, value: int, delay: float = 0.0):
  time.sleep(delay)
  return np.full((n,), value, dtype=np.uint8)


@sidecar.function
def stats(a):
  a = np.asarray(a)
  return {"sum": float(a.astype(np.float64).sum()), "shape": list(a.shape), "dtype": a.dtype.name,
          "writeable": bool(a.flags.writeable)}


@sidecar.function
def die():
  os.kill(os.getpid(), signal.SIGKILL)


@sidecar.function
def identity_env():
  return {"pid": os.getpid()}


@sidecar.function
def count(n: int, nbytes: int = 0):
  """Yields n items; with nbytes, each carries an array of that size (through the arena)."""
  for i in range(n):
    with _log_lock:
      _log.append(("produced", i))
    yield {"i": i, "data": np.full((nbytes,), i % 251, np.uint8)} if nbytes else i


@sidecar.function
def count_then_fail(n: int):
  yield from range(n)
  raise RuntimeError(f"failed after {n}")


@sidecar.function
def echo_items(x, n: int):
  for _ in range(n):
    yield x


@sidecar.function
def made_in_place(n: int, value: int):
  out = sidecar.empty((n,), np.uint8)
  out[:] = value
  return out


@sidecar.function
def overwrite(a, value: int):
  """Writes ``value`` into its argument in place (an arena view, when it came as one)."""
  a[...] = value


@sidecar.function
def slow_count(n: int, delay: float):
  """Yields 0..n-1, one every ``delay`` seconds: a slow pipeline, not a hung one."""
  for i in range(n):
    time.sleep(delay)
    yield i


@sidecar.function
def size_of(a) -> int:
  """The bytes of ``a``: a call that costs what decoding its argument costs, no more."""
  return int(np.asarray(a).nbytes)
