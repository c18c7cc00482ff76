"""Keep ``ocp.CheckpointManager``; let the sidecars carry the bytes.

A checkpoint handler for Orbax: the manager names, commits, lists and garbage-collects
steps as usual, while this handler's item is saved the sidecar way (the trainer
stalls for one copy into shared memory; the sidecars write the item in stock
Orbax's layout and merge it) and restored from the sidecars' RAM tier when they
hold it. Example::

  handler = sidecar.orbax.SidecarCheckpointHandler(ctl)
  mngr = ocp.CheckpointManager(directory, item_names=("state", "data"),
                               item_handlers={"state": handler})
  mngr.save(step, args=ocp.args.Composite(state=sidecar.orbax.SidecarSave(state),
                                          data=sidecar.orbax.FeedStateSave(feed.state())))
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=sidecar.orbax.SidecarRestore(abstract_state)))["state"]
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.ckptfmt.orbax import read as orbax_read
from sidecar._src.controller.checkpoint import orbax_items
from sidecar._src.controller.checkpoint.checkpointer import Checkpointer, Target
from sidecar._src.core import errors
from sidecar._src.wire import codec


class SidecarCheckpointHandler(ocp.AsyncCheckpointHandler):
  """An Orbax ``AsyncCheckpointHandler`` whose bytes go through the sidecars."""

  def __init__(self, controller: Any, *, ram_steps: int = 1, ram_budget: int | None = None):
    self._controller = controller
    self._ram = (ram_steps, ram_budget)
    self._engines: dict[str, Checkpointer] = {}

  def _engine(self, directory: str) -> Checkpointer:
    engine = self._engines.get(directory)
    if engine is None:
      engine = self._controller.checkpointer(directory, ram_steps=self._ram[0],
                                             ram_budget=self._ram[1], sweep=False)
      self._engines[directory] = engine
    return engine

  @staticmethod
  def _step(item: pathlib.Path) -> int:
    m = re.match(r"(\d+)", item.parent.name)
    if m is None:
      raise errors.InvalidArgumentError(
          f"cannot tell the step of item directory {item}; SidecarCheckpointHandler works "
          "with ocp.CheckpointManager's step directories")
    return int(m.group(1))

  async def async_save(self, directory, args: SidecarSave):
    item = pathlib.Path(directory)
    target = _item_target(item, self._step(item))
    handle = orbax_items.save_item(self._engine(target.directory), target, args.item)
    return [_Durable(handle, self, target)]

  def save(self, directory, args: SidecarSave) -> None:
    item = pathlib.Path(directory)
    target = _item_target(item, self._step(item))
    handle = orbax_items.save_item(self._engine(target.directory), target, args.item)
    _Durable(handle, self, target).result()

  def restore(self, directory, args: SidecarRestore | None = None) -> Any:
    if args is None or args.item is None:
      raise errors.InvalidArgumentError(
          "SidecarRestore(target) needs a target pytree of jax.ShapeDtypeStructs (with "
          "shardings) or arrays")
    item = pathlib.Path(directory)
    engine = self._engine(str(item.parent.parent))
    return orbax_items.restore_item(engine, str(item), self._step(item), args.item)

  def metadata(self, directory) -> dict[Any, Any]:
    """The saved tree, read from the item's files: ``jax.ShapeDtypeStruct`` leaves.

    Nested dicts by key path (sequence indices as int keys); no shardings.
    """
    tree: dict[Any, Any] = {}
    for leaf in orbax_read.item_leaves(directory):
      *parents, last = leaf["key_path"]
      node = tree
      for key in parents:
        node = node.setdefault(key, {})
      node[last] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), codec.dtype_of(leaf["dtype"]))
    return tree

  def finalize(self, directory) -> None:
    pass

  def close(self) -> None:
    for engine in self._engines.values():
      engine.close()


def _item_target(item: pathlib.Path, step: int) -> Target:
  """The item directory ``item`` of a step an ``ocp.CheckpointManager`` commits (in its
  directory ``<directory>/<step>/<item>``), in Orbax's layout."""
  return Target.in_step(formats_lib.DEFAULT.get(formats_lib.ORBAX), str(item.parent.parent),
                        str(item), step)


class _Durable:
  """The future Orbax waits on before it commits the step."""

  def __init__(self, handle, handler: SidecarCheckpointHandler, target: Target):
    self._handle, self._handler, self._target = handle, handler, target

  def result(self, timeout: float | None = None) -> Any:
    out = self._handle.durable.result(timeout)
    # The manager renames the step right after this; the RAM tier keys on the final path.
    orbax_items.item_committed(self._handler._engine(self._target.directory),
                                    self._target)
    return out


@ocp.args.register_with_handler(SidecarCheckpointHandler, for_save=True)
@dataclasses.dataclass
class SidecarSave(ocp.args.CheckpointArgs):
  """Save ``item`` (a pytree of jax.Arrays, numpy arrays and scalars) through the sidecars."""
  item: Any


@ocp.args.register_with_handler(SidecarCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class SidecarRestore(ocp.args.CheckpointArgs):
  """Restore onto ``item``: a pytree of jax.ShapeDtypeStructs with shardings, or arrays."""
  item: Any = None
