"""What a sidecar knows of who sent it a save's value: :class:`Caller`.

A save's values (``ckptfmt/save_values``) are the trainer's, as it sent them; who sent
one is the sidecar's own knowledge (the session its handshake made, the worker attached
in its name, its tenant, how long it waits), never a field of the value. The servicer
(``service.py``) makes one Caller per request and hands it, beside the value, to the step
writer's verb of that value (``save.StepWriter``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# The longest a caller waits: a Prepared or Replicate with no timeout_s, an Abort's commit.
LONG_S = 3600.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
  """Who sent a save's value, as this sidecar knows it.

  ``owner``: the caller's session (a save belongs to the sessions that staged it).
  ``worker``: the worker session attached in its name ("" none); ``alive``: whether that
  worker is still attached (the trainer is there; None: not known). ``tenant``: its pool
  tenant (None: none; its session counts then). ``wait_s``: how long it waits for the
  answer (what it asked, within its deadline).
  """

  owner: str = ""
  worker: str = ""
  alive: Callable[[], bool] | None = None
  tenant: str | None = None
  wait_s: float = LONG_S
