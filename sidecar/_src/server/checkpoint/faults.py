"""Fault injection for the checkpoint crash tests; unset in production.

``SIDECAR_CKPT_FAULT="POINT@STEP"`` makes this sidecar SIGKILL itself there (points:
stage, write, prepared, commit, read: serving a restore's shard of the step), or
"slow@STEP" pause 2 s before writing ("slow@STEP:PATH": until the file PATH exists, at
most ``HOLD_S``: a test holds a step not durable while it looks), "slowstage@STEP" (and
"slowstage@STEP:PATH") the same before a Stage of STEP is taken (a step not staged yet),
"slowcommit@STEP" (and "...:PATH") before a commit of STEP begins (``StepWriter``: it is
written and decided, nothing of it renamed), "slowrename@STEP" (and "...:PATH") inside it,
its files in place and its last rename to come (a DCP step's only where it replaces a
committed one) (a test makes an abort meet either);
"replicate@STEP" kills it as another sidecar's first shards of STEP arrive, once its own
part of STEP is committed (so the step is durable and its replication half done);
"enospc@STEP" fails the write with ENOSPC (a full disk) at its first progress: every part
of this host's share of STEP arrived (the formats wait for their writes only once the
last one did) and its first shard is on disk, so it fails a whole step's write, never one
mid-save; "eio@STEP" with EIO there (a failing disk), each "...:PATH" only once the file
PATH exists (a test fails a write it held till then); "swap@STEP" kills it in the middle of a
DCP commit that replaces a committed checkpoint at its path (``ckptfmt/dcp/commit.finalize``).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time

from sidecar._src.core import env as env_lib

log = logging.getLogger(__name__)
FAULT_ENV = env_lib.CKPT_FAULT
HOLD_S = 120.0  # the longest "slow@STEP:PATH" waits for PATH
HOLDS = ("slow", "slowstage", "slowcommit", "slowrename")  # the points that pause, not kill


def armed(point: str, step: int) -> bool:
  """Whether the fault ``point`` is set for ``step``."""
  return (env_lib.get(FAULT_ENV) or "").split(":", 1)[0] == f"{point}@{step}"


def fault(point: str, step: int) -> None:
  """Acts out the fault ``point`` if it is set for ``step``; else does nothing."""
  if armed(point, step):
    _, _, path = (env_lib.get(FAULT_ENV) or "").partition(":")
    if point in HOLDS:
      log.info("fault injection: holding %s of step %d%s", point, step,
               f" until {path} exists" if path else "", extra={"step": step})
      _hold(path, HOLD_S if path else 2.0)
      return
    if point in ("enospc", "eio"):
      if path:
        _hold(path, HOLD_S)
      code = errno.ENOSPC if point == "enospc" else errno.EIO
      raise OSError(code, f"{os.strerror(code)} (fault injection, step {step})")
    log.warning("fault injection: SIGKILL at %s of step %d", point, step, extra={"step": step})
    os.kill(os.getpid(), signal.SIGKILL)


def _hold(path: str, most_s: float) -> None:
  """Waits until the file ``path`` exists (none: ``most_s``), at most ``most_s``."""
  deadline = time.monotonic() + most_s
  while time.monotonic() < deadline and not (path and os.path.exists(path)):
    time.sleep(0.05)


def mid_commit(step: int) -> None:
  """The fault points inside a commit of ``step``, its files in place and its last rename
  to come (``Format.commit``'s ``swapping``)."""
  fault("swap", step)
  fault("slowrename", step)
