"""Where a step goes: its directories (:class:`Target`), the hosts that keep its
replicas (:func:`replica_hosts`), and the handle its saver waits on (:class:`SaveHandle`).

A step's directories are its format's (``ckptfmt.Format``): a :class:`Target` places
nothing itself, so a new format with any layout changes nothing here."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
from typing import Any

from sidecar._src.ckptfmt.format import Format


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
  """Where a step goes: the directory its save writes, and where that is once committed.

  ``directory``: where the step lies (what its save opens). ``tmp_step``: the whole
  uncommitted step, which an aborted save removes once every host let go of it (Begin's
  answer); empty where another commits the step (``whole_step`` False). ``fmt``: the
  format whose layout every directory here is.
  """
  directory: str
  step: int
  tmp_dir: str
  final_dir: str
  whole_step: bool  # True: our commit renames the step; False: another (Orbax's manager)
  tmp_step: str
  fmt: Format

  @classmethod
  def for_step(cls, fmt: Format, path: str, step: int, *, directory: str | None = None
               ) -> Target:
    """Step ``step`` of ``path`` (what Begin is given: a checkpoint root for Orbax's
    layout, the checkpoint itself for DCP's) in ``fmt``'s layout, not begun. Its
    ``final_dir`` is ``fmt``'s (:meth:`Format.final_dir`), made of ``path`` as the client
    spells it, never resolved: the manifest's directory, the RAM tier's key and what a
    restore reads. Its tmp directories are Begin's answer (:meth:`begun`). ``directory``:
    where the step lies, default ``path``."""
    return cls(path if directory is None else directory, step, "", fmt.final_dir(path, step),
               True, "", fmt)

  def begun(self, tmp_step: str) -> Target:
    """This step once a sidecar began it in ``tmp_step`` (Begin's answer): written where
    its format stages in that directory (:meth:`Format.staged_dirs`); its ``final_dir``
    stays the client's own."""
    tmp_dir, _ = self.fmt.staged_dirs(tmp_step)
    return dataclasses.replace(self, tmp_dir=tmp_dir, tmp_step=tmp_step)

  @classmethod
  def in_step(cls, fmt: Format, directory: str, tmp_dir: str, step: int) -> Target:
    """``tmp_dir``, a directory inside an uncommitted step of ``directory`` that another
    commits (an ``ocp.CheckpointManager``): written where it is; once committed, where
    ``fmt`` puts it (:meth:`Format.final_of`; itself if it lies in no uncommitted step)."""
    found = fmt.final_of(pathlib.Path(tmp_dir))
    final = tmp_dir if found is None else str(found.final)
    return cls(directory, step, tmp_dir, final, False, "", fmt)


@dataclasses.dataclass(frozen=True, slots=True)
class SaveHandle:
  """``staged``: the state is in the arenas (the trainer may change its arrays);
  ``durable``: the step is committed on storage; ``replicated``: every shard has its
  replica copies (``replicas=R``; at once with R=0, JAX's and PyTorch's alike). All are
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
