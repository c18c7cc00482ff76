"""A save's values: what the trainer sends a sidecar at each point of a step's save, one
frozen value each, and the order they come in.

A save runs between two plug-ins, as PyTorch DCP's ``StorageWriter`` documents its
method order (set up, local plan, global plan, write, finish): the trainer's side
(``controller/checkpoint/save_run.SaveRun`` builds every value, ``save_protocol.SaveProtocol``
sends each with the transport's one call, ``CheckpointTransport.send(host, value)``) and the
sidecar's (``server/checkpoint/service.py`` decodes a request into its value and hands it,
unchanged, to the step writer's verb of the same name, ``server/checkpoint/save.StepWriter``,
beside a frozen :class:`~sidecar._src.server.checkpoint.caller.Caller`: what the sidecar knows
of who sent it, never part of the value). ``wire/save_wire.py`` alone converts a value
to and from its request, by the value's type. A step's save is, in order:

1. :class:`Begin` (the lead process, on the host that commits): the step's uncommitted
   directory made in its format's layout; the answer is that directory. Or no Begin of its
   own: the first :class:`Stage` on that host carries it (one round trip less).
2. :class:`Stage` (every process, each on the hosts it stages into, a host's parts in
   order): a part of one host's shards, their bytes already in its arena; the answer is
   the bytes staged there so far. A host's first part carries the leaves, its ``last`` the
   sidecars' ``CommitPlan`` where they commit the step themselves: the host takes the step
   over before it answers.
3. Then one of two endings, the lead process's:

   - the sidecars commit it (a plan was staged): :class:`AwaitCommit`, on the committer,
     waits for the commit the sidecars agree on; or
   - the trainers commit it: :class:`Prepared` on every host (its shards' records once
     written, each with its crc32c), then one :class:`Commit` with all of them, on the
     host that began the step; the answer is the committed directory.

4. :class:`Committed` (every other host that staged a part): its RAM tier keeps the step as
   committed.

At any point before the commit answered, a failure sends :class:`Abort` instead, to the
committer first, then to every other host: each drops its part, and the step's files go
once none of them committed it.

A value's sequences are tuples (a list given becomes one): nothing that holds a value
changes it. A new field is one field here and its two lines in the wire module.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar._src.ckptfmt.records import CommitPlan, ShardRecord, Staged
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.core import errors

__all__ = ["Abort", "AwaitCommit", "Begin", "Commit", "Committed", "Prepared", "SaveValue",
           "Stage"]


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
  leaves: Sequence[LeafSpec] = ()
  shards: Sequence[Staged] = ()
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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Commit:
  """The commit of step ``step`` staged in ``tmp_dir`` on ``num_hosts`` hosts, each of
  which wrote its part: ``shards``, every host's records, written (their crc32c set).

  ``leaves``: the step's leaves. ``data_state_json``: the data position the manifest
  records. ``whole_step``: the commit renames the whole step (False: an Orbax handler's
  item, which its CheckpointManager commits). ``replicas``: which hosts hold each host's
  replicas (``{host: [hosts]}``), recorded in the manifest. ``extra``: the typed commit
  extra of the step's format, if it has one (a DCP step's ``DcpCommit``: its metadata, file
  sizes and plan).
  """

  tmp_dir: str
  step: int
  num_hosts: int
  shards: Sequence[ShardRecord]
  leaves: Sequence[LeafSpec] = ()
  data_state_json: str = ""
  whole_step: bool = True
  replicas: Mapping[int, Sequence[int]] | None = None
  extra: Any = None

  def __post_init__(self) -> None:
    _as_tuples(self, "leaves", "shards")
    if self.replicas is not None:
      object.__setattr__(self, "replicas", types.MappingProxyType(
          {h: tuple(p) for h, p in self.replicas.items()}))


@dataclasses.dataclass(frozen=True, slots=True)
class AwaitCommit:
  """The wait for the commit the sidecars agree on of step ``step`` staged in
  ``tmp_dir``, a step they took over (its Stages carried a plan naming this host its
  committer): the answer is the committed directory, or the error of why it was abandoned
  (a host's write failed, a host died)."""

  tmp_dir: str
  step: int


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
  """The wait for this host's part of the step whose committed directory is ``final_dir``
  to be written, at most ``timeout_s`` seconds (0: the sidecar's longest wait): the answer
  is its shards' records, each with its crc32c."""

  final_dir: str
  timeout_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Committed:
  """The step whose committed directory is ``final_dir`` is visible: the host's RAM tier
  keeps it as committed (``manifest_json``: its manifest, where the committing sidecar
  alone built it: a DCP step's). The answer is the steps the RAM tier keeps."""

  final_dir: str
  manifest_json: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
  """The host drops its part of the save staged in ``tmp_dir`` (an uncommitted step
  directory, or a directory inside one) and removes ``tmp_dir``; ``final_dir``: the step's
  committed directory (the RAM tier's key). The answer is "", or where the step is
  committed if this host committed it (its commit had begun before the abort came):
  nothing of it was removed then."""

  tmp_dir: str
  final_dir: str


# Whatever the transport's one call sends.
SaveValue = Begin | Stage | Prepared | Commit | AwaitCommit | Committed | Abort


def _as_tuples(value: Any, *names: str) -> None:
  """``value``'s fields ``names`` as tuples (a tuple stays the same object): a frozen
  value's sequences are immutable too."""
  for name in names:
    object.__setattr__(value, name, tuple(getattr(value, name)))
