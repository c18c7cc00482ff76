"""Noticing a lost host within a second: a short poll of every sidecar's Status.

Runs in the controller. A dead sidecar's port refuses at once; a hung one (SIGSTOP,
a partitioned host) lets the poll's deadline pass. Either way a host that has not
answered for ``lost_after`` seconds is lost, and ``on_lost(host_id, reason)`` is
called once for it, on the watch's own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from sidecar._src.protocol import pb

log = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 0.2
DEFAULT_LOST_AFTER_S = 0.6


class HealthWatch:
  """Polls ``rpcs`` (``{host_id: (Status callable, metadata)}``) until stopped.

  Use ``start()`` and ``stop()``; ``stop()`` joins the thread. Owned by a Controller.
  """

  def __init__(self, rpcs: Mapping[int, tuple[Any, tuple]], *,
               on_lost: Callable[[int, str], None], interval: float = DEFAULT_INTERVAL_S,
               lost_after: float = DEFAULT_LOST_AFTER_S):
    if interval <= 0 or lost_after <= 0:
      raise ValueError(f"interval and lost_after must be positive seconds, got {interval!r} "
                       f"and {lost_after!r}")
    self._rpcs = dict(rpcs)
    self._on_lost = on_lost
    self._interval, self._lost_after = interval, lost_after
    self._failing_since: dict[int, float] = {}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> HealthWatch:
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name="sidecar-health", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    """Stops polling and joins the thread; idempotent."""
    self._stop.set()
    thread, self._thread = self._thread, None
    if thread is not None and thread is not threading.current_thread():
      thread.join(self._interval + self._lost_after + 5)

  @property
  def watching(self) -> list[int]:
    return sorted(self._rpcs)

  def _loop(self) -> None:
    while not self._stop.is_set() and self._rpcs:
      t0 = time.monotonic()
      self._poll_once(deadline=self._lost_after)
      self._stop.wait(max(self._interval - (time.monotonic() - t0), 0.0))

  def _poll_once(self, *, deadline: float) -> None:
    futures = {h: rpc.future(pb.StatusRequest(), timeout=deadline, metadata=meta)
               for h, (rpc, meta) in self._rpcs.items()}
    now = time.monotonic()
    for h, future in futures.items():
      try:
        future.result()
      except grpc.RpcError as e:
        first = self._failing_since.setdefault(h, now)
        if time.monotonic() - first >= self._lost_after:
          reason = f"{e.code().name}: {e.details()}"
          del self._rpcs[h]
          self._failing_since.pop(h, None)
          log.warning("host %d is lost (%s)", h, reason)
          self._on_lost(h, reason)
        continue
      self._failing_since.pop(h, None)
