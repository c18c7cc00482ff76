"""A worker session's arena blocks over the worker socket: its ``alloc`` and ``free`` frames.

An ``alloc`` frame asks for one block (an argument's), or a save's blocks on this host in
one round trip: it gets every one, or none (those granted go back) and the error, within
its timeout. A pool tenant's request waits its turn in the admission queue (no timeout
given: as long as its turn takes), telling the worker its place in ``{"queued": place}``
frames where it reads them, and ends when the worker's connection says it is gone. A
``free`` frame, a feed's credit or a stream item that never arrived hands blocks back, as
(offset, generation) pairs, checked.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable
from typing import Any

from sidecar._src.core import errors
from sidecar._src.server import client_log
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.arenas.tenant_shares import ON_WAIT_S
from sidecar._src.server.goodput import steps as steps_lib
from sidecar._src.server.pool import admission
from sidecar._src.server.workers import conns
from sidecar._src.wire import ipc, protocol

log = logging.getLogger(__name__)

# The most often a queued alloc reports its place, whatever the worker asks.
MIN_REPORT_S = 0.05
# How long telling a queued alloc's worker its place may take: one that reads none of its
# replies for this long has its connection ended (a partial frame leaves it no other end).
TELL_S = 10.0


class SessionBlocks:
  """What worker sessions allocate and free of the arena (``leases``); a free is a sign of
  life of its session (``steps``: a feed's credit, its trainer took a batch)."""

  def __init__(self, leases: Leases, steps: steps_lib.Steps):
    self._leases = leases
    self.steps = steps

  def answer_alloc(self, conn: socket.socket, session: str, message: dict[str, Any], *,
                   frames: bool = False) -> dict[str, Any]:
    """The answer to ``session``'s ``alloc`` frame ``message`` on ``conn``: its blocks, or
    the error; ``frames``: whether the worker reads ``{"queued": place}`` frames."""
    try:
      timeout = alloc_timeout(message.get("timeout"), self._leases.queued(session))

      def on_wait(place: admission.Place) -> None:
        if frames:
          # A worker that does not read its replies (its socket full) is let go within
          # TELL_S; meanwhile its request stands aside (admission.Waiter.telling).
          before = conn.gettimeout()
          conn.settimeout(TELL_S)
          try:
            with conns.own_io():
              ipc.send(conn, {"queued": place.to_dict()})
          finally:
            conn.settimeout(before)

      # One block (an argument's), or a save's blocks on this host in one round trip.
      # The worker says how often it must hear (a third of its peer timeout, say).
      report_s = float(message.get("report_s", ON_WAIT_S))
      report_s = min(report_s, ON_WAIT_S) if report_s >= MIN_REPORT_S else MIN_REPORT_S
      reply: dict[str, Any] = {"blocks": self.alloc(
          message["sizes"], session, timeout, alive=lambda: conns.quiet(conn), on_wait=on_wait,
          report_s=report_s)}
    except errors.SidecarError as e:
      reply = {"error": protocol.error_dict(e)}
    except (KeyError, TypeError, ValueError) as e:
      reply = {"error": protocol.error_dict(
          errors.InvalidArgumentError(f"malformed alloc request {message!r:.200}: {e!r}"))}
    return reply

  def alloc(self, sizes: Any, session: str, timeout: float | None, *,
            alive: Callable[[], bool] | None = None,
            on_wait: Callable[[admission.Place], None] | None = None,
            report_s: float = ON_WAIT_S) -> list[list[int]]:
    """Blocks of ``sizes`` bytes held by ``session``, within ``timeout`` s (None: as long
    as its turn in the admission queue takes, while ``alive``) for all: every one, or none
    (those granted go back) and the error."""
    if not isinstance(sizes, list) or not 0 < len(sizes) <= ipc.MAX_ALLOC_BLOCKS:
      raise ValueError(f"sizes must be a list of 1 to {ipc.MAX_ALLOC_BLOCKS} byte counts")
    deadline = None if timeout is None else time.monotonic() + timeout
    blocks: list[list[int]] = []
    try:
      for n in sizes:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        block = self._leases.alloc(int(n), session, timeout=left, alive=alive,
                                   on_wait=on_wait, report_s=report_s)
        blocks.append([block.offset, block.nbytes, block.generation])
    except BaseException:
      for offset, _, generation in blocks:
        self._leases.release(offset, generation, session)
      raise
    return blocks

  def free(self, session: str, flat: list[int], *, client: str | None = None) -> None:
    """Releases ``session``'s hold on blocks given as flattened (offset, generation) pairs.

    Every block a session held when it ended went back then (``Workers._serve``: the
    session leaves ``steps``, then ``release_all``), but its other connections still hand
    blocks back after that: a feed's credits read once its trainer is gone, each naming
    blocks already released (no stale free: said nothing of), and the batch its stream
    made meanwhile and could not send (released here). A stale free of a live session is
    the worker's mistake, and warned of: one line a frame however many pairs it names
    (one a pair wrote 35 MB for a 1 MB frame: issue 76), within ``client``'s share of the
    log (``client_log``).
    """
    self.steps.heard(session)  # a feed's credit: its trainer took a batch
    if not flat:
      return
    released, stale = self._leases.release_each(flat, session)
    if stale and self._live(session):  # else released at its end, before this late free
      client_log.DEFAULT.warning(
          log, client, "worker %s: %d of the %d arena blocks it freed are not held by it "
          "(released already, reused, or never its own), e.g. offset %d generation %d; a "
          "worker frees each block it holds once", session, len(flat) // 2 - released,
          len(flat) // 2, *stale[0], extra={"session": session})

  def _live(self, session: str) -> bool:
    return self.steps.attached(session) is not None


def alloc_timeout(raw: Any, queued: bool) -> float | None:
  """An alloc request's ``timeout``: seconds >= 0 as given; none given: wait its turn in
  the admission queue (None) if the worker's tenant has one, else fail at once (0)."""
  if raw is None:
    return None if queued else 0.0
  timeout = float(raw)
  if not 0 <= timeout < math.inf:
    raise ValueError(f"timeout must be finite seconds >= 0, got {timeout!r}")
  return timeout


def free_pairs(pairs: Any) -> list[int]:
  """The flattened (offset, generation) pairs of a ``free`` message, checked.

  Raises:
    InvalidArgumentError: ``pairs`` is not a list of [int, int].
  """
  if isinstance(pairs, list) and all(
      isinstance(p, list) and len(p) == 2 and all(
          isinstance(x, int) and not isinstance(x, bool) for x in p) for p in pairs):
    return [x for pair in pairs for x in pair]
  raise errors.InvalidArgumentError(
      f"malformed free message: 'blocks' must be a list of [offset, generation] pairs, "
      f"got {pairs!r:.200}")
