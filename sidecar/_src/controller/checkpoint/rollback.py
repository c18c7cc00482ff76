"""The checkpointer's half of an in-process rollback: the save in flight, from the RAM tiers.

Once the sidecars took a save over, it can be restored from their RAM tiers before it is
durable. ``controller/recovery.Recovery`` calls :func:`restore_taken_over` in every process
together when a step raised; where it answers None, the rollback goes to a committed step
(``Checkpointer.restore``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.core import errors, interrupts

log = logging.getLogger(__name__)


@interrupts.deferring
def restore_taken_over(ckpt: Checkpointer, target: Any
                       ) -> tuple[int, Any, dict[str, Any] | None] | None:
  """Restores the save in flight from the sidecars' RAM tiers once they took it over
  in every process, durable or not (its write goes on; if it fails, the next save
  raises it, as any failed save's); returns ``(step, tree, data position)``. None
  where there is nothing to restore so (no save in flight, its stage failed, or its
  trainers commit it) or it does not restore whole: then nothing is restored. Waits
  for the save's ``staged`` (its copy and Stages), never for its write. Every process
  calls it together, and all take the same answer (``controller/recovery.Recovery``).
  """
  ckpt._check_open()
  t0 = time.perf_counter()
  handle = ckpt.save_in_flight()
  step = None
  if handle is not None:
    interrupts.wait_done(handle.staged)
    if handle.staged.exception() is None and handle.taken_over.done() and (
        handle.taken_over.result()):
      step = handle.step
  ckpt._restores += 1
  key = f"{ckpt._key}/rollback/{ckpt._restores}"
  if ckpt._peers.count > 1 and len(set(ckpt._peers.all_gather(key, json.dumps(step)))) > 1:
    return None  # some process's part was not taken over: its save fails
  if step is None:
    return None
  restored = None
  try:
    restored = ckpt._driver.restore_taken_over(step, target)
  except errors.SidecarError as e:  # its text only: its frames would hold the blocks read
    log.warning("step %d, taken over by the sidecars, could not be restored from their RAM "
                "tiers (%s: %s): rolling back to a committed step", step,
                type(e).__name__, str(e).splitlines()[0] if str(e) else "")
  if ckpt._peers.count > 1 and not all(json.loads(v) for v in ckpt._peers.all_gather(
      f"{key}/done", json.dumps(restored is not None))):
    return None  # restored here, not in every process: all roll back further alike
  if restored is None:
    return None
  ckpt.restored_step = step
  ckpt._log_restore()
  if ckpt._goodput is not None:  # a restore, as restore()'s: the ledger's rollback
    ckpt._goodput.restored(step, time.perf_counter() - t0)
  return step, restored[0], restored[1]
