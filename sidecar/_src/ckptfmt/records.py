"""What crosses the ``sidecar.v1.Checkpoint`` service, as frozen values: one type per concept.

Both halves use these, the trainer's (``controller/checkpoint/client.py``) and the
sidecar's (``server/checkpoint/``); ``wire/checkpoint_wire.py`` converts them to and
from protobuf and does nothing else, and a dict appears only where a manifest file is
read or written (:meth:`Manifest.to_json`, :meth:`Manifest.from_json`).

- :class:`ShardId`: a shard of a leaf (its key path and where it lies).
- :class:`ShardRecord`: one shard of a save, from the plan to the manifest (its id,
  number, host, dtype, shape, size, DCP rank, and its crc32c once written); its bytes
  travel beside it in a :class:`Staged`. :func:`shard_crc32c` is that checksum (of the
  shard's C-order bytes: every format's writer sets it, ``ShardRecord.with_crc32c_of``) and
  :func:`check_crc32c` a read's check against it, :func:`check_form` of its dtype and shape:
  a restore carries the manifest's record down to the read, both sides check the copy by it.
- :class:`ReplicaTarget`: a sidecar that holds replicas of this one's shards. The
  protocol's message is still called ``Peer``; in new code a sidecar-to-sidecar link
  is a replica target, never a "peer" (which means the trainer's processes).
- :class:`Replicated`: what a replication sent; :class:`ReplicaHeader` and
  :class:`ReplicaPiece` (with whole shards as :class:`Staged`): what one sidecar's
  ``Receive`` stream to another carries.
- :class:`Held`: what one sidecar's RAM tier holds under a directory.
- :class:`CommitPlan`: what the sidecars need to commit a step themselves (a trainer's
  last part of a step carries it): its committer, its hosts, its data position; and
  :class:`AgreeState`: one host's state in their agreement on it (``Agree``).
- :class:`SavedLeaf`, :class:`Manifest`: a committed step's manifest, which owns its
  file name (:data:`MANIFEST_FILE`) and its JSON (which carries its own crc32c: an edited
  manifest is refused); :meth:`Manifest.of_save` is the one builder a commit uses, whatever
  the format.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import crc32c as crc32c_lib
import numpy as np

from sidecar._src.ckptfmt.spec import Index, KeyPath, LeafSpec
from sidecar._src.core import errors

MANIFEST_FILE = "sidecar_manifest.json"  # in a committed step's item directory (or DCP step)
MANIFEST_VERSION = 1
# A manifest's "format" is its format's one name (``Format.name``, the registry's key). Steps
# in Orbax's layout saved before formats had one name each say "colocated-sidecar": read as
# "orbax" (Orbax's name), never written.
OLD_NAMES: Mapping[str, str] = types.MappingProxyType({"colocated-sidecar": "orbax"})
# A manifest's file begins with the crc32c of the rest of its JSON (``{"crc32c":N,`` and
# then the body's text after its "{"): checked on every read, so that a manifest changed
# after its save (a dtype, a checksum) is refused rather than believed. One an earlier
# release wrote has none.
_DIGEST_HEAD = b'{"crc32c":'
# The extras key of a manifest made for a directory a stock tool wrote (no manifest file):
# nothing in it can be checked (``Manifest.stock``).
STOCK = "stock"
_EMPTY: Mapping[str, Any] = types.MappingProxyType({})


def as_index(index: Sequence[Sequence[int]]) -> Index:
  """``index`` as ``((start, stop), ...)`` of ints."""
  return tuple((int(a), int(b)) for a, b in index)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardId:
  """A shard of a leaf: the leaf's key path and where the shard lies in the global array
  (a DCP item: ``((fqn,), ((start, stop), ...))``, a bytes item's index empty).

  Unpacks as ``key_path, index = shard``, as the tuples it replaces did.
  """

  key_path: KeyPath
  index: Index

  def __iter__(self) -> Iterator[Any]:
    return iter((self.key_path, self.index))


@dataclasses.dataclass(frozen=True, slots=True)
class ShardRecord:
  """One shard of a save, from the trainer's plan to the step's manifest: the one
  description of it that a framework adapter makes (its host not chosen yet), the
  trainer stages, the wire carries (``pb.ShardRecord``), the format's numbering checks,
  the writer and replication take and the manifest lists. Its bytes travel beside it
  (:class:`Staged`), never in it.

  Attributes:
    id: the shard (its leaf's key path, or a DCP item's ``(fqn,)``, and where it lies):
      its key in the RAM tier and in the manifest.
    leaf: its number: its leaf's in the step's leaves, or its item's in a DCP rank's items
      (-1: not recorded, a manifest of an earlier release's).
    host: the host that stages and writes it (None: not known, a stock Orbax item; not
      chosen yet, a framework adapter's record before the save's plan sets it, :meth:`on`).
    dtype: its elements' numpy name as staged ("": not recorded); a DCP bytes item's
      is ``uint8``.
    shape: its shape as staged (``()`` where ``dtype`` is not recorded).
    nbytes: its bytes (0: not known, a stock Orbax item).
    rank: the DCP rank whose item it is; None for a leaf of the step.
    crc32c: the crc32c of its C-order bytes once written (``with_crc32c``); None until then,
      and for a stock Orbax item (nothing to check).
  """

  id: ShardId
  leaf: int
  host: int | None
  dtype: str
  shape: tuple[int, ...]
  nbytes: int
  rank: int | None = None
  crc32c: int | None = None

  @classmethod
  def of(cls, shard: ShardId, leaf: int, data: Any, *, host: int | None = None,
         rank: int | None = None) -> ShardRecord:
    """The record of ``data`` (an array, or anything with its numpy ``dtype``, ``shape`` and
    ``nbytes``: a device copy on its way), not yet written."""
    return cls(shard, leaf, host, data.dtype.name, tuple(data.shape), int(data.nbytes), rank)

  @property
  def key_path(self) -> KeyPath:
    return self.id.key_path

  @property
  def index(self) -> Index:
    return self.id.index

  def on(self, host: int) -> ShardRecord:
    """This record with the host that stages and writes it (a save's plan chooses it)."""
    return dataclasses.replace(self, host=host)

  def with_crc32c(self, crc32c: int) -> ShardRecord:
    """This record with its bytes' checksum (a writer's, once written; a replica's sender's)."""
    return dataclasses.replace(self, crc32c=crc32c)

  def with_crc32c_of(self, data: np.ndarray) -> ShardRecord:
    """This record with the checksum of ``data``, its bytes (:func:`shard_crc32c`)."""
    return self.with_crc32c(shard_crc32c(data))

  def to_dict(self) -> dict[str, Any]:
    """The manifest's entry for this shard (the keys of an earlier release's first)."""
    return {"key_path": list(self.id.key_path), "index": [list(i) for i in self.id.index],
            "nbytes": self.nbytes, "crc32c": self.crc32c, "host": self.host,
            "leaf": self.leaf, "dtype": self.dtype, "shape": list(self.shape),
            "rank": self.rank}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ShardRecord:
    """A manifest's entry; an earlier release's (key path, index, nbytes, crc32c, host)
    reads with its leaf, dtype and shape not recorded."""
    return cls(ShardId(tuple(d["key_path"]), as_index(d["index"])), int(d.get("leaf", -1)),
               None if d.get("host") is None else int(d["host"]), str(d.get("dtype") or ""),
               tuple(int(n) for n in d.get("shape") or ()), int(d.get("nbytes") or 0),
               None if d.get("rank") is None else int(d["rank"]),
               None if d.get("crc32c") is None else int(d["crc32c"]))


def shard_crc32c(data: np.ndarray) -> int:
  """crc32c of an array's C-order bytes, as :attr:`ShardRecord.crc32c` records it."""
  # memoryview takes any ndarray; numpy declares __buffer__ only from Python 3.12 on.
  flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  return crc32c_lib.crc32c(memoryview(flat))  # type: ignore[arg-type]


def check_crc32c(final_dir: str, record: ShardRecord, data: np.ndarray, what: str) -> None:
  """CorruptCheckpointError unless ``data`` (the ``what`` of the shard ``record`` describes,
  as its step's manifest lists it) has the record's crc32c; a record with none (a stock
  Orbax item's) has nothing to check."""
  if record.crc32c is not None and shard_crc32c(data) != record.crc32c:
    raise errors.CorruptCheckpointError(
        f"{final_dir}: {_named(record.id)} does not match its crc32c in {MANIFEST_FILE} "
        f"({what}): the file is corrupt or was changed after the save")


def check_form(final_dir: str, record: ShardRecord, data: np.ndarray, what: str) -> None:
  """CorruptCheckpointError unless ``data`` has the dtype and shape ``record`` says the save
  staged (a record of an earlier release's manifest says none: nothing to check): a copy
  whose metadata was changed reads the same bytes as other numbers, and its crc32c still
  matches."""
  if record.dtype and (data.dtype.name, tuple(data.shape)) != (record.dtype, record.shape):
    raise errors.CorruptCheckpointError(
        f"{final_dir}: {_named(record.id)} came from the {what} as "
        f"{data.dtype.name}{list(data.shape)}, where the save wrote "
        f"{record.dtype}{list(record.shape)}: its metadata was changed after the save")


def _named(shard: ShardId) -> str:
  name = ".".join(str(k) for k in shard.key_path)
  return f"array {name!r} shard {[list(i) for i in shard.index]}"


@dataclasses.dataclass(frozen=True, slots=True)
class Staged:
  """A shard's record and its bytes beside it: ``data`` (an arena view, on the sidecar;
  on the trainer, its arena block) and, where the trainer maps that arena, ``ref`` (the
  block's ``wire.codec.ArenaRef``; ``ckptfmt`` imports no wire). No second description:
  what the shard is, is ``record``'s."""

  record: ShardRecord
  data: np.ndarray
  ref: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaTarget:
  """A sidecar that is to hold replicas of this sidecar's shards (the ``Peer`` message)."""

  host_id: int
  address: str  # gRPC host:port
  socket: str = ""  # its worker socket, usable where boot_id is this machine's
  boot_id: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaHeader:
  """Which replica a ``Receive`` stream carries: ``source``'s shards of a step's item."""

  directory: str
  step: int
  final_dir: str  # the committed item directory
  source: int  # the host whose shards these are


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaPiece:
  """Some of one shard's C-order bytes, inline (the bytes travel beside, unparsed): the
  receiver assembles the shard (``record``: its crc32c the sender's, of the whole
  shard, checked once it is whole) in a block of its arena."""

  record: ShardRecord
  offset: int  # of these bytes in the shard's


@dataclasses.dataclass(frozen=True, slots=True)
class Replicated:
  """What one replication sent: to which hosts, how many shards and bytes, in how long."""

  hosts: tuple[int, ...]
  shards: int
  nbytes: int
  seconds: float


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CommitPlan:
  """What the sidecars need to commit a step among themselves, whatever its trainers do:
  each trainer process sends it with its last part of the step on each host; once a host's
  part is whole, that host takes the step over (``server/checkpoint/agreement.py``).

  Attributes:
    save: the save's id (unique, the beginning process's): two saves of a step never mix.
    committer: the host that commits the step (the one it was begun on).
    hosts: every host the step is staged on.
    data_state_json: the data position; the beginning process's (``lead``) is the manifest's.
    lead: whether the process that began the step sent it.
    replicas: which hosts hold each host's replicas (recorded in the manifest).
  """

  save: str
  committer: int
  hosts: tuple[int, ...]
  data_state_json: str = ""
  lead: bool = False
  replicas: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

  def __post_init__(self) -> None:
    if not self.save or self.committer not in self.hosts:
      raise errors.InvalidArgumentError(
          f"a commit plan names its save and a committer among its hosts, got save "
          f"{self.save!r:.100}, committer {self.committer}, hosts {list(self.hosts)[:64]}")

  def same_save(self, other: CommitPlan) -> bool:
    """Whether ``other`` (another process's) plans the same save: its id, committer, hosts."""
    return (self.save, self.committer, self.hosts) == (other.save, other.committer, other.hosts)


class Standing(enum.Enum):
  """Where one host stands in the sidecars' agreement on a step (``AgreeState.standing``)."""
  UNKNOWN = "unknown"  # it knows no such save (a sidecar restarted since)
  TAKEN_OVER = "taken over"  # its part is whole there, being written
  WRITTEN = "written"  # its part is written
  FAILED = "failed"  # its part could not be written
  COMMITTED = "committed"  # the committer's decision
  ABANDONED = "abandoned"  # the committer's decision: never committed

  @property
  def decided(self) -> bool:
    return self in (Standing.COMMITTED, Standing.ABANDONED)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AgreeState:
  """One host's state in the sidecars' agreement on a save they took over: what a host
  tells the committer, and what the committer answers (its decision once taken).

  Attributes:
    final_dir, save, step: the step and its save (``CommitPlan.save``).
    host: whose state this is.
    standing: where that host stands.
    records: ``WRITTEN``: its shards as written (empty once the committer holds them).
    error: ``FAILED``, ``ABANDONED``: why.
    committed: ``COMMITTED``: the committed step's directory.
    written: the committer's answer: the hosts whose written records it holds.
    plan, directory, format: ``TAKEN_OVER``: the plan, the checkpoint directory and the
      format, for a committer that has no part of the step yet.
  """

  final_dir: str
  save: str
  step: int
  host: int
  standing: Standing
  records: tuple[ShardRecord, ...] = ()
  error: BaseException | None = None
  committed: str = ""
  written: tuple[int, ...] = ()
  plan: CommitPlan | None = None
  directory: str = ""
  format: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
  """What one host's RAM tier holds under a directory, per committed item directory:
  its own shards, and the replicas it holds of other hosts' by source host."""

  own: Mapping[str, Sequence[ShardId]]
  replicas: Mapping[str, Mapping[int, Sequence[ShardId]]]


@dataclasses.dataclass(frozen=True, slots=True)
class SavedLeaf:
  """A leaf as its step saved it: a stock Orbax item tells no more than key path, shape
  and dtype (``kind`` is then its value type, or empty)."""

  key_path: KeyPath
  shape: tuple[int, ...]
  dtype: str  # the numpy name: "float32", "bfloat16"
  kind: str = ""
  write_shape: tuple[int, ...] = ()  # empty: not known (a stock Orbax item)
  sharding: str | None = None

  @classmethod
  def of(cls, spec: LeafSpec) -> SavedLeaf:
    return cls(spec.key_path, spec.shape, spec.dtype.name, spec.kind.value,
               tuple(spec.write_shape or ()), spec.sharding)

  def to_dict(self) -> dict[str, Any]:
    return {"key_path": list(self.key_path), "shape": list(self.shape), "dtype": self.dtype,
            "kind": self.kind, "write_shape": list(self.write_shape), "sharding": self.sharding}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> SavedLeaf:
    return cls(tuple(d["key_path"]), tuple(int(n) for n in d["shape"]), str(d["dtype"]),
               str(d.get("kind") or ""), tuple(int(n) for n in d.get("write_shape") or ()),
               d.get("sharding"))


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Manifest:
  """A committed item's manifest: its format (``Format.name``), its leaves, its shards
  (their records: the host that wrote each, its checksum), the data position saved with it, which
  hosts hold each host's replicas, and what its format adds (``extras``: a DCP step's
  ``plan``).

  Its file is ``MANIFEST_FILE`` in the committed directory, JSON (:meth:`to_json`).
  """

  format: str
  leaves: tuple[SavedLeaf, ...]
  shards: tuple[ShardRecord, ...]
  data_state: Any
  replicas: Mapping[int, tuple[int, ...]]
  extras: Mapping[str, Any]
  step: int | None

  def __init__(self, format: str, leaves: Sequence[SavedLeaf],  # noqa: A002 - the field
               shards: Sequence[ShardRecord], data_state: Any = None,
               replicas: Mapping[int, Sequence[int]] | None = None, *,
               extras: Mapping[str, Any] | None = None, step: int | None = None):
    extras = dict(extras or {})
    set_ = object.__setattr__
    set_(self, "format", format)
    set_(self, "leaves", tuple(leaves))
    set_(self, "shards", tuple(shards))
    set_(self, "data_state", data_state)
    set_(self, "replicas", types.MappingProxyType(
        {int(h): tuple(int(p) for p in ps) for h, ps in (replicas or {}).items()}))
    set_(self, "extras", types.MappingProxyType(extras) if extras else _EMPTY)
    set_(self, "step", step)

  @property
  def dcp_plan(self) -> Mapping[str, Any] | None:
    """A DCP step's plan (``sidecar/_src/torch/metadata.to_plan``), or None."""
    return self.extras.get("plan")

  @classmethod
  def of_save(cls, format: str, *, step: int, leaves: Sequence[LeafSpec],  # noqa: A002
              shards: Sequence[ShardRecord], data_state_json: str,
              replicas: Mapping[int, Sequence[int]] | None,
              extras: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest a commit writes: the one builder, for every format."""
    try:
      data_state = json.loads(data_state_json) if data_state_json else None
    except ValueError as e:
      raise errors.InvalidArgumentError(f"data_state_json is not JSON: {e}") from None
    return cls(format, [SavedLeaf.of(s) for s in leaves], shards, data_state, replicas,
               extras=extras, step=step)

  def to_json(self) -> str:
    """The file's text."""
    out: dict[str, Any] = {
        "format": self.format, "version": MANIFEST_VERSION, "step": self.step,
        **self.extras, "leaves": [leaf.to_dict() for leaf in self.leaves],
        "shards": [c.to_dict() for c in self.shards], "data_state": self.data_state}
    if self.replicas:
      out["replicas"] = {str(h): list(ps) for h, ps in self.replicas.items()}
    body = json.dumps(out, separators=(",", ":"))
    return f'{_DIGEST_HEAD.decode()}{crc32c_lib.crc32c(body.encode())},{body[1:]}'

  @classmethod
  def from_json(cls, text: str | bytes, where: str) -> Manifest:
    """The manifest a file holds, its crc32c checked.

    Raises:
      CorruptCheckpointError: the text does not match the crc32c it begins with, or has
        one that no longer heads it (reformatted): it was changed after the save.
      InvalidArgumentError: it is not a manifest at all; both name ``where``.
    """
    raw = text.encode() if isinstance(text, str) else bytes(text)
    _check_digest(raw, where)
    try:
      d = json.loads(raw)
      if not raw.startswith(_DIGEST_HEAD) and "crc32c" in d:
        raise errors.CorruptCheckpointError(
            f"{where}: its {MANIFEST_FILE} has a crc32c that no longer heads it: the file "
            "was rewritten after the save, so its checksums, dtypes and shapes cannot be "
            "trusted; restore an older step")
      extras = {k: v for k, v in d.items() if k not in _KEYS}
      name = str(d["format"])
      return cls(OLD_NAMES.get(name, name), [SavedLeaf.from_dict(x) for x in d["leaves"]],
                 [ShardRecord.from_dict(c) for c in d["shards"]], d.get("data_state"),
                 {int(h): ps for h, ps in (d.get("replicas") or {}).items()},
                 extras=extras, step=None if d.get("step") is None else int(d["step"]))
    except errors.CorruptCheckpointError:
      raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise errors.InvalidArgumentError(
          f"{where}: its manifest is not one this sidecar wrote ({type(e).__name__}: {e}); "
          "restore it with Orbax, or an older step") from None

  @property
  def stock(self) -> bool:
    """Whether this was made for a directory a stock tool (Orbax, DCP) wrote: no checksum,
    nothing of the sidecar's to check its files against."""
    return bool(self.extras.get(STOCK))


def _check_digest(raw: bytes, where: str) -> None:
  """CorruptCheckpointError unless ``raw`` (a manifest file's bytes) matches the crc32c it
  begins with, if it begins with one (an earlier release's has none)."""
  if not raw.startswith(_DIGEST_HEAD):
    return
  head, _, rest = raw.partition(b",")
  try:
    expected = int(head[len(_DIGEST_HEAD):])
  except ValueError:
    expected = None
  if expected is None or crc32c_lib.crc32c(b"{" + rest) != expected:
    raise errors.CorruptCheckpointError(
        f"{where}: its {MANIFEST_FILE} does not match the crc32c it was written with: it "
        "was changed after the save, so its checksums, dtypes and shapes cannot be trusted; "
        "restore an older step")


_KEYS = frozenset({"crc32c", "format", "version", "step", "leaves", "shards", "data_state",
                   "replicas"})
