"""Noticing a lost host within a second: a short poll of every sidecar's Status.

Runs in the controller. A dead sidecar's port refuses at once; a hung one (SIGSTOP,
a partitioned host) lets the poll's deadline pass. Either way a host that has not
answered for ``lost_after`` seconds is lost, and ``on_lost(host_id, reason)`` is
called once for it, on the watch's own thread. With ``rejoin``, a second thread asks
about each lost host every :data:`PROBE_S`; a host whose sidecar is back (a new one at
the same address) is watched again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 0.2
DEFAULT_LOST_AFTER_S = 0.6
PROBE_S = 1.0  # how often a lost host is asked whether it is back


class HealthWatch:
  """Polls ``rpcs`` (``{host_id: (Status callable, metadata)}``) until stopped.

  ``rejoin(host_id)`` (optional) tries to reconnect to a lost host; it returns the
  host's new ``(Status callable, metadata)``, or None while the host is still gone.
  Use ``start()`` and ``stop()``; ``stop()`` joins the threads. Owned by a Controller.
  """

  def __init__(self, rpcs: Mapping[int, tuple[Any, tuple]], *,
               on_lost: Callable[[int, str], None], interval: float = DEFAULT_INTERVAL_S,
               lost_after: float = DEFAULT_LOST_AFTER_S,
               rejoin: Callable[[int], tuple[Any, tuple] | None] | None = None):
    if interval <= 0 or lost_after <= 0:
      raise ValueError(f"interval and lost_after must be positive seconds, got {interval!r} "
                       f"and {lost_after!r}")
    self._lock = threading.Lock()
    self._rpcs = dict(rpcs)
    self._lost: list[int] = []  # lost while watched, in order
    self._on_lost, self._rejoin = on_lost, rejoin
    self._interval, self._lost_after = interval, lost_after
    self._failing_since: dict[int, float] = {}
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []

  def start(self) -> HealthWatch:
    if not self._threads:
      loops = [(self._loop, "sidecar-health")]
      if self._rejoin is not None:
        loops.append((self._probe_loop, "sidecar-health-rejoin"))
      self._threads = [threading.Thread(target=f, name=name, daemon=True) for f, name in loops]
      for t in self._threads:
        t.start()
    return self

  def stop(self) -> None:
    """Stops polling and joins the threads; idempotent."""
    self._stop.set()
    threads, self._threads = self._threads, []
    for t in threads:
      if t is not threading.current_thread():
        t.join(self._interval + self._lost_after + PROBE_S + 30)

  @property
  def watching(self) -> list[int]:
    with self._lock:
      return sorted(self._rpcs)

  def _loop(self) -> None:
    while not self._stop.is_set():
      t0 = time.monotonic()
      self._poll_once(deadline=self._lost_after)
      self._stop.wait(max(self._interval - (time.monotonic() - t0), 0.0))

  def _poll_once(self, *, deadline: float) -> None:
    with self._lock:
      rpcs = dict(self._rpcs)
    futures = {h: rpc.future(pb.StatusRequest(), timeout=deadline, metadata=meta)
               for h, (rpc, meta) in rpcs.items()}
    now = time.monotonic()
    for h, future in futures.items():
      try:
        future.result()
      except grpc.RpcError as e:
        first = self._failing_since.setdefault(h, now)
        if time.monotonic() - first >= self._lost_after:
          reason = f"{e.code().name}: {e.details()}"
          with self._lock:
            del self._rpcs[h]
            self._lost.append(h)
          self._failing_since.pop(h, None)
          log.warning("host %d is lost (%s)", h, reason)
          self._on_lost(h, reason)
        continue
      self._failing_since.pop(h, None)

  def _probe_loop(self) -> None:
    assert self._rejoin is not None
    while not self._stop.wait(PROBE_S):
      with self._lock:
        lost = list(self._lost)
      for h in lost:
        if self._stop.is_set():
          return
        back = self._rejoin(h)
        if back is not None:
          with self._lock:
            self._lost.remove(h)
            self._rpcs[h] = back
