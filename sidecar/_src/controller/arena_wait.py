"""A call that waits for arena room says so while it waits: :class:`ArenaWait`.

In a pool (``sidecar serve --pool``), a call's arguments and its result take arena blocks
of the caller's tenant; where they do not fit what is free to it now (its guaranteed
``arena``, the arena others do not hold, its ``arena_ceiling``), the sidecar waits for room
in its admission queue (docs/pool.md, "Admission") until the call's timeout, and only then
answers (``ResourceExhaustedError``, its place and how long it waited). Before, the caller
saw nothing meanwhile: a call sat its whole timeout, silent.

So a call that has had no answer for :data:`SAY_AFTER_S` asks its sidecar's Status, every
:data:`EVERY_S`, whether the caller's tenant has requests waiting in that arena queue
(``TenantStatus.waiting``, the caller's own row: what the sidecar knows). Where it has, the
call says so once in a warning (the call, the tenant, the queue, how long it waited and how
long it may wait: its timeout) and on a tqdm line where one is seen, redrawn with each look;
the line goes when the call ends. A call whose sidecar has no tenants, or a tenant with
nothing queued (a long function), says nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sidecar._src.core import progress

log = logging.getLogger(__name__)

SAY_AFTER_S = 2.0  # a call with no answer for this long asks whether it waits for arena
EVERY_S = 2.0  # and then asks again this often
STATUS_TIMEOUT_S = 1.0  # each look's own bound: a busy sidecar is asked again later


class ArenaWait:
  """The looks of one call (``name`` on host ``host_id``, through ``conn``'s Status) at its
  tenant's place in the arena queue; ``timeout``: the call's, how long it may wait."""

  def __init__(self, conn: Any, host_id: int, name: str, timeout: float):
    self._conn, self._host_id, self._name, self._timeout = conn, host_id, name, timeout
    self._started = time.monotonic()
    self._next = self._started + SAY_AFTER_S
    self._said = False
    self._bar: Any = None

  def look(self) -> None:
    """Called while the call waits (often): asks the sidecar where due, and says what it
    found. Never raises: a look that fails says nothing."""
    now = time.monotonic()
    if now < self._next:
      return
    self._next = now + EVERY_S
    try:
      from sidecar._src.wire.protocol import pb  # loaded with gRPC already: the call's
      status = self._conn.status_rpc(pb.StatusRequest(), timeout=STATUS_TIMEOUT_S,
                                     metadata=self._conn.metadata)
    except Exception:  # noqa: BLE001 - a look is a courtesy: the call's own wait decides
      return
    waiting = sum(t.waiting for t in status.tenants if t.name == status.tenant)
    if not status.tenant or not waiting:
      return
    waited, left = now - self._started, max(self._timeout - (now - self._started), 0.0)
    text = (f"call {self._name!r} on host {self._host_id}: tenant {status.tenant!r} waits "
            f"in the sidecar's arena queue ({waiting} of its requests there: this call's "
            f"arguments or result, past the arena free to it), for {waited:.0f} s; it gives "
            f"up in {left:.0f} s (its timeout, {self._timeout:.3g} s)")
    if not self._said:
      self._said = True
      log.warning("%s; free arrays it holds (results kept), or ask for a larger arena share "
                  "(docs/pool.md, Admission)", text)
    if progress.enabled():
      if self._bar is None:
        self._bar = progress.bar(text)
      else:
        self._bar.set_description_str(text)

  def close(self) -> None:
    """The call ended: its line goes."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None
