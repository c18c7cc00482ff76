"""An Orbax manager's items through a Checkpointer: what ``sidecar.orbax``'s handler calls.

What ``sidecar.orbax``'s handler (``jax/orbax_handler.py``) does with a Checkpointer whose
steps an ``ocp.CheckpointManager`` numbers, commits and lists: not the public
Checkpointer's, whose users save and restore its own steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.controller.checkpoint.save_protocol import Target
from sidecar._src.controller.checkpoint.save_run import SaveHandle


def save_item(ckpt: Checkpointer, target: Target, tree: Any) -> SaveHandle:
  """Copies ``tree`` into the arenas; the sidecars write ``target``, an item of a step
  the manager commits (``Target.in_step``). On the controller's live hosts, as ``save``:
  a host lost since the last save is left out, a host back has the directory opened."""
  ckpt._follow()
  return ckpt._start(target, tree, None)


def item_committed(ckpt: Checkpointer, target: Target) -> None:
  """Tells the RAM tiers that ``target``'s step is committed (by the manager, its item
  now at its final path, the RAM tier's key); lists a whole step (``target.whole_step``)."""
  ckpt._driver.mark_committed(target)
  if target.whole_step:
    ckpt._retention.add(target.step)


def restore_item(ckpt: Checkpointer, final_dir: str, step: int, target: Any, *,
                 progress: Callable[[str], None] | None = None) -> Any:
  """Restores the committed item at ``final_dir`` (of step ``step``) onto ``target``'s
  shardings."""
  tree = ckpt._driver.restore_from(final_dir, step, target, progress=progress)
  ckpt._log_restore()
  return tree
