"""What a client's requests write to the sidecar's log, bounded per client.

A line a request causes (its refusal, a frame it got wrong, its session's start and end)
costs the sidecar a write, and a client decides how many it sends: one ``free`` frame of
170,000 stale blocks wrote 35 MB of log (a line per block) and took 8 s of the sidecar's
CPU, and bad ``phase`` frames were logged a line each, unthrottled (issue 76, attack round
eight). So every such line goes through ``ClientLog``, keyed by its client: its tenant
(a pool's, or a client token's), else its session, else (a worker connection that has not
attached) the Unix user the kernel names. Each client has a token bucket of ``BURST``
lines, refilled at ``PER_S`` a second; a line past it is dropped and counted, and one
summary line says how many were dropped, and the last of them, when its client's next line
passes, or at the first line of anyone ``SUMMARY_S`` after the first drop, or at
``flush`` (a worker session's end). A line of the sidecar's own (no client) never passes
through here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sidecar._src.wire import protocol

BURST = 20
PER_S = 1.0
SUMMARY_S = 10.0
# Clients remembered at once: past it, those whose bucket is full and owe no summary go.
MAX_CLIENTS = 4096

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Bucket:
  tokens: float
  at: float
  dropped: int = 0
  first_drop: float = 0.0
  last: tuple[str, tuple] = ("", ())  # the last line dropped: its format and arguments


class ClientLog:
  """Token buckets of log lines, one per client; thread-safe."""

  def __init__(self, *, burst: int = BURST, per_s: float = PER_S,
               summary_s: float = SUMMARY_S, clock: Callable[[], float] = time.monotonic):
    self.burst, self.per_s, self.summary_s = burst, per_s, summary_s
    self._clock = clock
    self._lock = threading.Lock()
    self._buckets: dict[str, _Bucket] = {}

  def log(self, logger: logging.Logger, level: int, client: str | None, msg: str, *args: Any,
          **kwargs: Any) -> bool:
    """Logs ``msg % args`` at ``level`` on ``logger`` if ``client``'s bucket holds a line
    (``client`` None: the sidecar's own line, always); whether it was logged."""
    if client is None:
      logger.log(level, msg, *args, **kwargs)
      return True
    if not logger.isEnabledFor(level):
      return False
    now = self._clock()
    owed: list[tuple[str, _Bucket]] = []
    with self._lock:
      b = self._buckets.get(client)
      if b is None:
        self._make_room()
        b = self._buckets[client] = _Bucket(tokens=float(self.burst), at=now)
      b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.per_s)
      b.at = now
      passes = b.tokens >= 1.0
      if passes:
        b.tokens -= 1.0
        if b.dropped:
          owed.append((client, self._settle(b)))
      else:
        if not b.dropped:
          b.first_drop = now
        b.dropped += 1
        b.last = (msg, args)
      owed += [(c, self._settle(x)) for c, x in self._buckets.items()
               if x.dropped and c != client and now - x.first_drop >= self.summary_s]
    for who, summary in owed:
      self._summarize(who, summary, now)
    if passes:
      logger.log(level, msg, *args, **kwargs)
    return passes

  def warning(self, logger: logging.Logger, client: str | None, msg: str, *args: Any,
              **kwargs: Any) -> bool:
    return self.log(logger, logging.WARNING, client, msg, *args, **kwargs)

  def info(self, logger: logging.Logger, client: str | None, msg: str, *args: Any,
           **kwargs: Any) -> bool:
    return self.log(logger, logging.INFO, client, msg, *args, **kwargs)

  def flush(self, client: str | None = None) -> None:
    """Writes the summary ``client`` owes (every client's: None) now."""
    now = self._clock()
    with self._lock:
      owed = [(c, self._settle(b)) for c, b in self._buckets.items()
              if b.dropped and client in (None, c)]
    for who, summary in owed:
      self._summarize(who, summary, now)

  def dropped(self, client: str) -> int:
    """Lines of ``client`` dropped and not yet summarized."""
    with self._lock:
      b = self._buckets.get(client)
      return 0 if b is None else b.dropped

  def _settle(self, b: _Bucket) -> _Bucket:
    """A copy of ``b``'s drops, which it no longer owes. The lock is held."""
    owed = dataclasses.replace(b)
    b.dropped, b.last = 0, ("", ())
    return owed

  def _summarize(self, client: str, owed: _Bucket, now: float) -> None:
    log.warning("%s: %d log lines dropped in the last %.1f s (a client's requests write at "
                "most %d lines at once, then %g a second); the last: %s",
                protocol.for_log(client), owed.dropped, max(now - owed.first_drop, 0.0),
                self.burst, self.per_s, _text(*owed.last))

  def _make_room(self) -> None:
    """Forgets clients that owe nothing, oldest first, while MAX_CLIENTS are known. The
    lock is held."""
    if len(self._buckets) < MAX_CLIENTS:
      return
    for c in [c for c, b in self._buckets.items() if not b.dropped][:len(self._buckets) // 4]:
      del self._buckets[c]


def client_of(tenant: str | None, session: object, remote: str) -> str:
  """Whose log lines an RPC's are: its tenant's, else its handshake session's, else its
  connection's (gRPC's peer string)."""
  if tenant:
    return f"tenant {tenant!r}"
  if isinstance(session, str) and session:
    return f"session {session:.40}"
  return f"client {remote}"


def _text(msg: str, args: tuple) -> str:
  try:
    text = msg % args if args else msg
  except (TypeError, ValueError):
    text = msg
  return protocol.for_log(text)


# The sidecar process's one instance (a test may make its own).
DEFAULT = ClientLog()
