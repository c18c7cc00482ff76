"""The checkpointer's half of an in-process rollback: the save in flight, not waited for.

A save in flight is restored before it is durable, from where its bytes are now: while
it is not staged yet (its copy off the devices under way), from the copies it holds on
the devices (``Driver.restore_on_device``: device to device, in arrays of the trainer's
own); once the sidecars took it over, from their RAM tiers. ``controller/recovery.Recovery``
calls :func:`restore_taken_over` in every process together when a step raised; where it
answers None, the rollback goes to a committed step (``Checkpointer.restore``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, NamedTuple

from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.controller.checkpoint.save_run import SaveHandle
from sidecar._src.core import errors, interrupts

log = logging.getLogger(__name__)


class Rolled(NamedTuple):
  """A save in flight, restored: its step, the tree, its data position; ``staged_s``:
  how long the rollback waited for the save to be staged (0 where it restored the
  copies on the devices)."""
  step: int
  tree: Any
  data_state: dict[str, Any] | None
  staged_s: float = 0.0


@interrupts.deferring
def restore_taken_over(ckpt: Checkpointer, target: Any) -> Rolled | None:
  """Restores the save in flight, durable or not (its copy and write go on; if they
  fail, the next save raises it, as any failed save's); None where there is nothing to
  restore so (no save in flight, its stage failed, or its trainers commit it) or it does
  not restore whole in every process: then nothing is restored.

  Where the save is not staged yet in every process, each restores it from the copies it
  holds on its devices, without waiting for them to land; else (or where some process
  holds none that make its whole part) each waits for the save's ``staged`` (its copy
  and Stages), never for its write, and restores it from the sidecars' RAM tiers once
  they took it over in every process. Every process calls it together, and all take the
  same answer (``controller/recovery.Recovery``).
  """
  ckpt._check_open()
  t0 = time.perf_counter()
  handle = ckpt.save_in_flight()
  ckpt._restores += 1
  key = f"{ckpt._key}/rollback/{ckpt._restores}"
  rolled = _on_device(ckpt, handle, target, f"{key}/device")
  if rolled is None:
    rolled = _from_ram_tiers(ckpt, handle, target, key)
  if rolled is None:
    return None
  ckpt.restored_step = rolled.step
  ckpt._log_restore()
  if ckpt._goodput is not None:  # a restore, as restore()'s: the ledger's rollback
    ckpt._goodput.restored(rolled.step, time.perf_counter() - t0)
  return rolled


def _on_device(ckpt: Checkpointer, handle: SaveHandle | None, target: Any, key: str
               ) -> Rolled | None:
  """The save in flight from the copies it holds on the devices, where it is not staged
  yet and they make its whole part in every process; else None."""
  restored = None
  if handle is not None and not handle.staged.done():
    try:
      restored = ckpt._driver.restore_on_device(handle.step, target)
    except Exception as e:  # a device short of memory, say: the RAM tiers' way is left
      log.warning("step %d, not staged yet, could not be restored from its copies on the "
                  "devices (%s: %s): restoring it from the sidecars' RAM tiers once staged",
                  handle.step, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
  step = handle.step if restored is not None and handle is not None else None
  if not _same_in_every_process(ckpt, key, step):
    return None  # not in every process: all wait for the copy alike
  if restored is None or step is None:
    return None
  return Rolled(step, restored[0], restored[1])


def _from_ram_tiers(ckpt: Checkpointer, handle: SaveHandle | None, target: Any, key: str
                    ) -> Rolled | None:
  """The save in flight from the sidecars' RAM tiers once staged and taken over in every
  process (waits for ``staged``); else None."""
  step, waited = None, 0.0
  if handle is not None:
    t0 = time.perf_counter()
    interrupts.wait_done(handle.staged)
    waited = time.perf_counter() - t0
    if handle.staged.exception() is None and handle.taken_over.done() and (
        handle.taken_over.result()):
      step = handle.step
  if not _same_in_every_process(ckpt, key, step):
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
  return Rolled(step, restored[0], restored[1], waited)


def _same_in_every_process(ckpt: Checkpointer, key: str, step: int | None) -> bool:
  """Whether every process of the job calls this with the same ``step`` (under ``key``)."""
  return ckpt._peers.count == 1 or len(set(ckpt._peers.all_gather(key, json.dumps(step)))) == 1
