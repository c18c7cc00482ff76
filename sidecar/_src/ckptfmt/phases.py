"""A save's phases as the trainer sends them to a sidecar: one frozen value per phase.

The trainer's side builds a phase's value once (``controller/checkpoint/save_protocol.py``),
the transport hands it to ``wire/checkpoint_wire.py``, the one module that converts it to
and from its protobuf request, and the sidecar's servicer hands the value it decoded,
unchanged, to its writer (``server/checkpoint/save.py``). What the sidecar knows of the
caller itself (its session, its worker, whether that is still attached) is no part of a
phase's value: the writer takes it beside the value. A new field of a phase is one field
here and its two lines in the wire module. A value's sequences are tuples (a list given
becomes one): nothing that holds a value changes it.

- :class:`Begin`: the beginning of a step (its uncommitted directory made, in its
  format's layout), by a Begin of its own or by the step's first :class:`Stage` on the
  host that begins it (which carries it).
- :class:`Stage`: a part of one host's shards of a step (its first carries the leaves
  and may begin the step; its last may carry the sidecars' :class:`CommitPlan`).
- :class:`Commit`: the commit of a step every host wrote (or the wait for the one the
  sidecars agree on, ``taken_over``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar._src.ckptfmt.records import CommitPlan, ShardRecord, Staged
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.core import errors

__all__ = ["Begin", "Commit", "Stage"]


@dataclasses.dataclass(frozen=True, slots=True)
class Begin:
  """The beginning of step ``step`` of ``directory`` in format ``format`` (a registered
  format's name, ``ckptfmt/registry.py``: ``"orbax"``, ``"dcp"``; always named): the
  sidecar makes the step's uncommitted directory in that format's layout (``"orbax"``:
  ``<directory>/<step>.orbax-checkpoint-tmp``; ``"dcp"``: ``directory`` is the
  checkpoint's own, its tmp directory beside it) and holds the step for the caller's
  save while its trainer is there.
  """

  directory: str
  step: int
  format: str


@dataclasses.dataclass(frozen=True, slots=True)
class Stage:
  """A part of one host's shards of step ``step`` of ``directory`` (the checkpoint
  directory the step lies in), written into ``tmp_dir`` (the uncommitted item directory),
  which is ``final_dir`` once committed (the RAM tier's key).

  ``leaves``: the step's leaves (a host's first part carries them). ``shards``: this
  part's shards, each record with its bytes beside it. ``last``: the sender's last part of
  the step on this host; ``writers``: how many trainer processes stage into this host,
  each sending its own ``last``. ``extra``: the typed extra of the step's format, if it has
  one (a DCP rank's ``DcpPart``: its items, the shards' records' ``leaf`` numbering them).
  ``plan`` (with ``last``): the sidecars commit the step themselves; the host takes it
  over once its part is whole, before the call that made it whole answers.
  ``begin``: this part begins the step first, as that Begin would (its ``directory`` and
  ``step`` this part's; ``tmp_dir`` where its save writes in what that makes): the first
  part on the host that begins it; None: begun already.
  """

  directory: str
  step: int
  tmp_dir: str
  final_dir: str
  leaves: Sequence[LeafSpec]
  shards: Sequence[Staged]
  last: bool = True
  writers: int = 1
  extra: Any = None
  plan: CommitPlan | None = None
  begin: Begin | None = None

  def __post_init__(self) -> None:
    _as_tuples(self, "leaves", "shards")
    if self.begin is not None and (self.begin.directory, self.begin.step) != (
        self.directory, self.step):
      raise errors.InvalidArgumentError(
          f"a Stage of step {self.step} of {self.directory!r:.200} cannot begin step "
          f"{self.begin.step} of {self.begin.directory!r:.200}: a Stage begins its own step "
          "(give it the Begin of its directory and step, or none)")


@dataclasses.dataclass(frozen=True, slots=True)
class Commit:
  """The commit of step ``step`` staged in ``tmp_dir`` on ``num_hosts`` hosts, each of
  which wrote its part: ``shards``, every host's records, written (their crc32c set).

  ``leaves``: the step's leaves. ``data_state_json``: the data position the manifest
  records. ``whole_step``: the commit renames the whole step (False: an Orbax handler's
  item, which its CheckpointManager commits). ``replicas``: which hosts hold each host's
  replicas (``{host: [hosts]}``), recorded in the manifest. ``extra``: the typed commit
  extra of the step's format, if it has one (a DCP step's ``DcpCommit``: its metadata, file
  sizes and plan). ``taken_over``: the sidecars commit the step themselves (its Stages
  carried a plan naming this host its committer): this waits for that commit instead
  (no ``shards`` given).
  """

  tmp_dir: str
  step: int
  num_hosts: int
  leaves: Sequence[LeafSpec]
  shards: Sequence[ShardRecord]
  data_state_json: str
  whole_step: bool
  replicas: Mapping[int, Sequence[int]] | None = None
  extra: Any = None
  taken_over: bool = False

  def __post_init__(self) -> None:
    _as_tuples(self, "leaves", "shards")
    if self.replicas is not None:
      object.__setattr__(self, "replicas", types.MappingProxyType(
          {h: tuple(p) for h, p in self.replicas.items()}))


def _as_tuples(value: Any, *names: str) -> None:
  """``value``'s fields ``names`` as tuples (a tuple stays the same object): a frozen
  value's sequences are immutable too."""
  for name in names:
    object.__setattr__(value, name, tuple(getattr(value, name)))
