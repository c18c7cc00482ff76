"""Where a step goes: its directories (:class:`Target`), the hosts that keep its
replicas (:func:`replica_hosts`), and the handle its saver waits on (:class:`SaveHandle`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
from typing import Any

from sidecar._src.ckptfmt import spec as spec_lib


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
  """Where a step goes: the item directory written, and where it is once committed.

  ``tmp_step``: the whole uncommitted step, which an aborted save removes once every
  host let go of it (the item's parent in stock Orbax's layout; a DCP checkpoint's tmp
  directory itself); empty where another commits the step (``whole_step`` False).
  """
  directory: str
  step: int
  tmp_dir: str
  final_dir: str
  whole_step: bool  # True: we commit the step (rename); False: Orbax's manager does
  tmp_step: str = ""

  @classmethod
  def for_step(cls, directory: str, step: int) -> Target:
    """Step ``step`` of ``directory`` in stock Orbax's layout, not begun: its tmp
    directories are what the sidecar's ``begin`` answers (:meth:`begun`)."""
    return cls(directory, step, "", str(pathlib.Path(directory) / str(step) / spec_lib.ITEM),
               True, "")

  def begun(self, tmp_step: str) -> Target:
    """This step once a sidecar began it in ``tmp_step`` (``begin``'s answer): its item is
    written in that directory."""
    return dataclasses.replace(self, tmp_dir=str(pathlib.Path(tmp_step) / spec_lib.ITEM),
                               tmp_step=tmp_step)

  @classmethod
  def for_orbax_item(cls, item: str, step: int) -> Target:
    """An item directory inside a step that an ``ocp.CheckpointManager`` commits."""
    path = pathlib.Path(item)
    final = path.parent.with_name(path.parent.name.split(spec_lib.TMP_SUFFIX)[0]) / path.name
    return cls(str(path.parent.parent), step, str(path), str(final), False)

  @classmethod
  def for_checkpoint(cls, path: str, tmp_dir: str, step: int) -> Target:
    """A checkpoint that is one directory (DCP's), written in ``tmp_dir`` beside it (as
    its sidecar began it) and renamed to ``path``; ``step`` orders it in the RAM tier."""
    return cls(str(pathlib.Path(path).parent), step, tmp_dir, path, True, tmp_dir)


@dataclasses.dataclass(frozen=True, slots=True)
class SaveHandle:
  """``staged``: the state is in the arenas (the trainer may change its arrays);
  ``durable``: the step is committed on storage; ``replicated``: every shard has its
  peer copies (``replicas=R``; at once with R=0, JAX's and PyTorch's alike). All are
  ``concurrent.futures.Future``s that hold the step (None for a skipped save)."""
  step: int
  staged: concurrent.futures.Future
  durable: concurrent.futures.Future
  replicated: concurrent.futures.Future = dataclasses.field(
      default_factory=concurrent.futures.Future)


def replica_hosts(slices: dict[int, int], host: int, replicas: int) -> list[int]:
  """The ``replicas`` hosts that keep copies of ``host``'s shards: the next hosts in host
  order (wrapping), those on another slice first."""
  order = sorted(slices)
  i = order.index(host)
  ring = order[i + 1:] + order[:i]
  return ([h for h in ring if slices[h] != slices[host]]
          + [h for h in ring if slices[h] == slices[host]])[:replicas]


def done_handle(step: int, value: Any) -> SaveHandle:
  staged, durable = concurrent.futures.Future(), concurrent.futures.Future()
  staged.set_result(value)
  durable.set_result(value)
  replicated: concurrent.futures.Future = concurrent.futures.Future()
  replicated.set_result(value)
  return SaveHandle(step, staged, durable, replicated)
