"""The checkpoint protocol's messages (``protos/sidecar/v1/checkpoint.proto``) <-> values.

Both sides of the ``Checkpoint`` service use these: the controller's client
(``controller/checkpoint/client.py``) and the sidecar's servicer
(``server/checkpoint/service.py``). Each side holds ``ckptfmt``'s frozen types
(``records``: ``ShardId``, ``ShardRecord`` (its bytes beside it in a ``Staged``),
``Replicated``, ``Held``, ``Manifest``; ``spec.LeafSpec``; a format's typed parts); this
module converts them to and from protobuf and does nothing else. Every ``*_from_pb``
checks what the message cannot say itself (an interval's order, a dtype on the
allow-list) and raises InvalidArgumentError naming the field.

A format's typed parts travel in the ``format_part`` oneofs of the Stage and Commit
requests; :data:`STAGE_EXTRAS` and :data:`COMMIT_EXTRAS` convert them, one entry per
member (a new format adds its entries).

A save's values (``ckptfmt/save_values``) are converted to and from their requests by
``wire/save_wire.py``, with the conversions of the records they carry here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from sidecar._src.ckptfmt import names
from sidecar._src.ckptfmt.dcp import DcpCommit, DcpPart
from sidecar._src.ckptfmt.records import (
  AgreeState,
  CommitPlan,
  Held,
  Manifest,
  ReplicaHeader,
  ReplicaPiece,
  Replicated,
  SavedLeaf,
  ShardId,
  ShardRecord,
  Staged,
  Standing,
)
from sidecar._src.ckptfmt.spec import Index, KeyPath, LeafKind, LeafSpec
from sidecar._src.ckptfmt.tiers import Tier
from sidecar._src.core import errors
from sidecar._src.wire import codec, pbscan, protocol
from sidecar._src.wire.protocol import ckpt_pb, pb

# Read tiers, as the protocol numbers them (the sidecar maps them back: a Tier is its name).
TIERS = {Tier.ANY: ckpt_pb.TIER_ANY, Tier.RAM: ckpt_pb.TIER_RAM,
         Tier.REPLICA: ckpt_pb.TIER_REPLICA, Tier.STORAGE: ckpt_pb.TIER_DISK}
MAX_DIMS = 64  # a shard's rank; more is no array numpy makes


def key_path_to_pb(kp: Iterable[str | int]) -> list[ckpt_pb.KeyEntry]:
  out = []
  for k in kp:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
      raise errors.InvalidArgumentError(
          f"a key path entry must be a str or an int, got {k!r:.100}")
    out.append(ckpt_pb.KeyEntry(index=k) if isinstance(k, int) else ckpt_pb.KeyEntry(key=k))
  return out


def key_path_from_pb(entries: Sequence[ckpt_pb.KeyEntry], where: str) -> KeyPath:
  out: list[str | int] = []
  for e in entries:
    kind = e.WhichOneof("kind")
    if kind is None:
      raise errors.InvalidArgumentError(f"{where}: a key path entry has neither key nor index")
    out.append(e.key if kind == "key" else e.index)
  if not out:
    raise errors.InvalidArgumentError(f"{where}: the key path is empty")
  # Its keys joined by dots name the leaf's files (Orbax's param_name): a name, not a path.
  names.check_name(".".join(str(k) for k in out), where,
                   fix="leaf keys are names: no '/' at the start, no '.'/'..' component, no NUL")
  return tuple(out)


def index_to_pb(index: Iterable[Sequence[int]]) -> list[ckpt_pb.Interval]:
  return [ckpt_pb.Interval(start=int(a), stop=int(b)) for a, b in index]


def index_from_pb(intervals: Sequence[ckpt_pb.Interval], where: str) -> Index:
  if len(intervals) > MAX_DIMS:
    raise errors.InvalidArgumentError(
        f"{where}: {len(intervals)} dimensions, at most {MAX_DIMS}")
  out = tuple((i.start, i.stop) for i in intervals)
  bad = [list(x) for x in out if not 0 <= x[0] <= x[1]]
  if bad:
    raise errors.InvalidArgumentError(
        f"{where}: each interval must be [start, stop) with 0 <= start <= stop, got {bad[0]}")
  return out


def shard_to_pb(kp: Iterable[str | int], index: Iterable[Sequence[int]]) -> ckpt_pb.ShardId:
  """A shard's message (``shard_to_pb(*shard_id)`` for a :class:`ShardId`)."""
  return ckpt_pb.ShardId(key_path=key_path_to_pb(kp), index=index_to_pb(index))


def shard_from_pb(shard: ckpt_pb.ShardId, where: str) -> ShardId:
  return ShardId(key_path_from_pb(shard.key_path, f"{where}.key_path"),
                 index_from_pb(shard.index, f"{where}.index"))


def shard_ids(shards: Iterable[ShardId]) -> ckpt_pb.ShardIds:
  return ckpt_pb.ShardIds(shards=[shard_to_pb(s.key_path, s.index) for s in shards])


def shards_from_ids(ids: ckpt_pb.ShardIds, where: str) -> list[ShardId]:
  return [shard_from_pb(s, where) for s in ids.shards]


def staged_to_pb(request: ckpt_pb.CheckpointStageRequest, shards: Iterable[Staged],
                 to_arena: codec.ToArena | None) -> None:
  """Adds ``shards`` to a Stage ``request``: each one's record, and beside it its bytes
  as its arena block where it has one (its ``ref``, or ``to_arena``'s), else inline."""
  for s in shards:
    request.records.append(record_to_pb(s.record))
    found = (lambda _, ref=s.ref: ref) if s.ref is not None else to_arena
    fill_data(request.data.add(), s.data, found)


def staged_from_pb(request: ckpt_pb.CheckpointStageRequest, from_arena: codec.FromArena | None,
                   views: Sequence[memoryview] = ()) -> list[Staged]:
  """A Stage request's shards: each record with its bytes beside it, views of their arena
  blocks (``from_arena``), or of the request's own bytes where ``pbscan.strip_arrays``
  left them (``views``); a record that does not describe its bytes is refused."""
  if len(request.data) != len(request.records):
    raise errors.InvalidArgumentError(
        f"a Stage carries one data per record: {len(request.records)} records, "
        f"{len(request.data)} data")
  out = []
  for i, (r, d) in enumerate(zip(request.records, request.data)):
    record = record_from_pb(r, f"records[{i}]")
    data = data_from_pb(d, from_arena, f"data[{i}]", views)
    if (record.dtype, record.shape, record.nbytes) != (data.dtype.name, data.shape, data.nbytes):
      raise errors.InvalidArgumentError(
          f"records[{i}] describes {list(record.shape)} {record.dtype} ({record.nbytes} "
          f"bytes), its data is {list(data.shape)} {data.dtype.name} ({data.nbytes} bytes)")
    out.append(Staged(record, data))
  return out


def leaf_to_pb(s: LeafSpec) -> ckpt_pb.LeafSpec:
  out = ckpt_pb.LeafSpec(key_path=key_path_to_pb(s.key_path), shape=s.shape,
                         dtype=s.dtype.name, kind=str(s.kind), write_shape=s.write_shape)
  if s.sharding is not None:
    out.sharding = s.sharding
  return out


def leaf_from_pb(leaf: ckpt_pb.LeafSpec, where: str) -> LeafSpec:
  """The LeafSpec ``leaf`` says, checked (its dtype on the allow-list, its kind known)."""
  if len(leaf.shape) > MAX_DIMS:
    raise errors.InvalidArgumentError(f"{where}: {len(leaf.shape)} dimensions, at most {MAX_DIMS}")
  try:
    return LeafSpec(key_path=key_path_from_pb(leaf.key_path, f"{where}.key_path"),
                    shape=tuple(leaf.shape), dtype=codec.dtype_of(leaf.dtype, where),
                    kind=LeafKind(leaf.kind), write_shape=tuple(leaf.write_shape),
                    sharding=leaf.sharding if leaf.HasField("sharding") else None)
  except (ValueError, TypeError) as e:  # LeafKind("bad"), say
    raise errors.InvalidArgumentError(f"{where}: {e}") from None


def saved_leaf_to_pb(leaf: SavedLeaf) -> ckpt_pb.LeafSpec:
  """A leaf of a manifest (a stock Orbax item's has no write shape nor sharding)."""
  out = ckpt_pb.LeafSpec(key_path=key_path_to_pb(leaf.key_path), shape=list(leaf.shape),
                         dtype=leaf.dtype, kind=leaf.kind, write_shape=list(leaf.write_shape))
  if leaf.sharding is not None:
    out.sharding = leaf.sharding
  return out


def leaf_info_from_pb(leaf: ckpt_pb.LeafSpec, where: str) -> SavedLeaf:
  """A saved leaf, as its step's manifest has it."""
  return SavedLeaf(key_path_from_pb(leaf.key_path, f"{where}.key_path"),
                   tuple(int(d) for d in leaf.shape), codec.dtype_of(leaf.dtype, where).name,
                   leaf.kind, tuple(int(d) for d in leaf.write_shape),
                   leaf.sharding if leaf.HasField("sharding") else None)


def record_to_pb(r: ShardRecord) -> ckpt_pb.ShardRecord:
  out = ckpt_pb.ShardRecord(shard=shard_to_pb(r.id.key_path, r.id.index), nbytes=r.nbytes,
                            leaf=r.leaf, dtype=r.dtype, shape=r.shape)
  if r.crc32c is not None:
    out.crc32c = r.crc32c
  if r.host is not None:
    out.host = r.host
  if r.rank is not None:
    out.rank = r.rank
  return out


def record_from_pb(r: ckpt_pb.ShardRecord, where: str) -> ShardRecord:
  """The record ``r`` says, checked (its dtype on the allow-list where it has one)."""
  if len(r.shape) > MAX_DIMS or any(d < 0 for d in r.shape):
    raise errors.InvalidArgumentError(f"{where}: bad shape {list(r.shape)[:8]}")
  dtype = codec.dtype_of(r.dtype, f"{where}.dtype").name if r.dtype else ""
  return ShardRecord(shard_from_pb(r.shard, f"{where}.shard"), r.leaf,
                     r.host if r.HasField("host") else None, dtype, tuple(r.shape), r.nbytes,
                     r.rank if r.HasField("rank") else None,
                     r.crc32c if r.HasField("crc32c") else None)


def dcp_part_to_pb(part: DcpPart) -> ckpt_pb.DcpPart:
  """A rank's part of a DCP step as its message (its items are the Stage's records)."""
  return ckpt_pb.DcpPart(rank=part.rank, item_count=part.item_count)


def dcp_part_from_pb(part: ckpt_pb.DcpPart, where: str) -> DcpPart:
  return DcpPart(part.rank, part.item_count)


def dcp_commit_to_pb(commit: DcpCommit | Mapping[str, Any]) -> ckpt_pb.DcpCommit:
  """What commits a DCP step as its message (a ``{"metadata", "file_sizes", "plan_json"}``
  dict taken too: the trainer's form until it sends a :class:`DcpCommit`)."""
  if not isinstance(commit, DcpCommit):
    commit = DcpCommit(commit["metadata"], commit["file_sizes"], commit["plan_json"])
  out = ckpt_pb.DcpCommit(metadata=commit.metadata, plan_json=commit.plan_json)
  for rank, size in commit.file_sizes.items():
    out.file_sizes[rank] = size
  return out


def dcp_commit_from_pb(commit: ckpt_pb.DcpCommit, where: str) -> DcpCommit:
  out = DcpCommit(commit.metadata, dict(commit.file_sizes), commit.plan_json)
  out.check_plan(f"{where}.plan_json")  # each item's file a name, one of the ranks' files
  return out


# A format's typed parts, by their member of the requests' ``format_part`` oneof:
# (its type, to message, from message). One entry per format that has parts.
STAGE_EXTRAS: dict[str, tuple[type, Callable[[Any], Any], Callable[[Any, str], Any]]] = {
    "dcp": (DcpPart, dcp_part_to_pb, dcp_part_from_pb)}
COMMIT_EXTRAS: dict[str, tuple[type, Callable[[Any], Any], Callable[[Any, str], Any]]] = {
    "dcp": (DcpCommit, dcp_commit_to_pb, dcp_commit_from_pb)}


def format_extra_to_pb(request: Any, extra: Any, table: Mapping[str, tuple]) -> None:
  """Sets ``request``'s ``format_part`` to ``extra`` (None: leaves it unset)."""
  if extra is None:
    return
  for member, (kind, to_pb, _) in table.items():
    if isinstance(extra, kind):
      getattr(request, member).CopyFrom(to_pb(extra))
      return
  raise errors.InvalidArgumentError(f"no format extra is a {type(extra).__name__}")


def format_extra_from_pb(request: Any, table: Mapping[str, tuple]) -> Any:
  """``request``'s ``format_part`` as its typed value; None where it has none."""
  member = request.WhichOneof("format_part")
  return None if member is None else table[member][2](getattr(request, member), member)


def replicas_to_pb(target: Any, placement: Mapping[Any, Iterable[int]] | None) -> None:
  """Fills the map ``target`` (host -> HostIds) from ``{host: [hosts holding its replicas]}``."""
  for h, hosts in (placement or {}).items():
    target[int(h)].hosts.extend(int(p) for p in hosts)


def replicas_from_pb(source: Mapping[int, ckpt_pb.HostIds]) -> dict[int, list[int]]:
  return {int(h): list(v.hosts) for h, v in source.items()}


def plan_to_pb(target: ckpt_pb.CommitPlan, plan: CommitPlan) -> None:
  target.save, target.committer, target.lead = plan.save, plan.committer, plan.lead
  target.hosts.extend(plan.hosts)
  target.data_state_json = plan.data_state_json
  replicas_to_pb(target.replicas, plan.replicas)


def plan_from_pb(plan: ckpt_pb.CommitPlan, where: str) -> CommitPlan:
  try:
    return CommitPlan(save=plan.save, committer=plan.committer, hosts=tuple(plan.hosts),
                      data_state_json=plan.data_state_json, lead=plan.lead,
                      replicas={h: tuple(p) for h, p in replicas_from_pb(plan.replicas).items()})
  except errors.InvalidArgumentError as e:
    raise errors.InvalidArgumentError(f"{where}: {e}") from None


# A host's standing is the proto's AgreePhase (its field ``phase``): the wire keeps its names.
_STANDINGS = {s: getattr(ckpt_pb, f"AGREE_{s.name}") for s in Standing}
_STANDINGS_BACK = {number: s for s, number in _STANDINGS.items()}


def agree_to_pb(a: AgreeState) -> ckpt_pb.AgreeState:
  out = ckpt_pb.AgreeState(final_dir=a.final_dir, save=a.save, step=a.step, host=a.host,
                           phase=_STANDINGS[a.standing],
                           records=[record_to_pb(r) for r in a.records], committed=a.committed,
                           written=a.written, directory=a.directory, format=a.format)
  if a.error is not None:
    out.error.CopyFrom(protocol.error_info(a.error))
  if a.plan is not None:
    plan_to_pb(out.plan, a.plan)
  return out


def agree_from_pb(a: ckpt_pb.AgreeState, where: str, *, sender: str) -> AgreeState:
  """An AgreeState from another sidecar (``sender``, for its error's text)."""
  standing = _STANDINGS_BACK.get(a.phase)
  if standing is None or a.step < 0:
    raise errors.InvalidArgumentError(
        f"{where}: phase {a.phase} and step {a.step}: one of AgreePhase's values and a step "
        ">= 0 are expected")
  return AgreeState(
      final_dir=a.final_dir, save=a.save, step=a.step, host=a.host, standing=standing,
      records=tuple(record_from_pb(r, f"{where}.records[{i}]") for i, r in enumerate(a.records)),
      error=(protocol.error_from_info(a.error, host=sender, host_id=a.host)
             if a.HasField("error") else None),
      committed=a.committed, written=tuple(a.written),
      plan=plan_from_pb(a.plan, f"{where}.plan") if a.HasField("plan") else None,
      directory=a.directory, format=a.format)


def replicated_to_pb(r: Replicated) -> ckpt_pb.CheckpointReplicateResponse:
  return ckpt_pb.CheckpointReplicateResponse(peers=r.hosts, shards=r.shards, bytes=r.nbytes,
                                             seconds=r.seconds)


def replicated_from_pb(r: ckpt_pb.CheckpointReplicateResponse) -> Replicated:
  return Replicated(tuple(r.peers), r.shards, r.bytes, r.seconds)


def replica_header_to_pb(h: ReplicaHeader, tenant: str | None = None) -> ckpt_pb.ReplicaHeader:
  """``h`` with the tenant whose replica it is (the sender authenticated it; None: none)."""
  return ckpt_pb.ReplicaHeader(directory=h.directory, step=h.step, final_dir=h.final_dir,
                               source=h.source, tenant=tenant or "")


def replica_header_from_pb(h: ckpt_pb.ReplicaHeader, where: str) -> ReplicaHeader:
  if h.step < 0:
    raise errors.InvalidArgumentError(f"{where}.step must be a non-negative int, got {h.step}")
  return ReplicaHeader(h.directory, h.step, h.final_dir, h.source)


def replica_blocks_from_pb(blocks: Sequence[ckpt_pb.ReplicaBlock],
                           from_arena: codec.FromArena | None, where: str) -> list[Staged]:
  """Whole shards of a replica: each record (its crc32c the sender's) with its bytes, a
  block of this side's arena."""
  out = []
  for i, b in enumerate(blocks):
    record = record_from_pb(b.record, f"{where}[{i}].record")
    out.append(Staged(record, data_from_pb(ckpt_pb.ShardData(arena=b.data), from_arena,
                                           f"{where}[{i}].data")))
  return out


def replica_piece_from_pb(p: ckpt_pb.ReplicaPart, where: str) -> ReplicaPiece:
  """A piece's description, the wire's ReplicaPart (its bytes travel beside:
  ``service.parse_receive``)."""
  record = record_from_pb(p.record, f"{where}.record")
  if not record.dtype:
    raise errors.InvalidArgumentError(f"{where}.record: no dtype")
  return ReplicaPiece(record, p.offset)


def held_to_pb(held: Held) -> ckpt_pb.CheckpointHeldResponse:
  out = ckpt_pb.CheckpointHeldResponse()
  for item, shards in held.own.items():
    out.own[item].CopyFrom(shard_ids(shards))
  for item, by_source in held.replicas.items():
    for source, shards in by_source.items():
      out.replicas[item].by_source[source].CopyFrom(shard_ids(shards))
  return out


def held_from_pb(r: ckpt_pb.CheckpointHeldResponse) -> Held:
  return Held(own={d: shards_from_ids(ids, "own") for d, ids in r.own.items()},
              replicas={d: {int(src): shards_from_ids(ids, "replicas")
                            for src, ids in h.by_source.items()}
                        for d, h in r.replicas.items()})


def manifest_to_pb(m: Manifest) -> ckpt_pb.CheckpointInfoResponse:
  out = ckpt_pb.CheckpointInfoResponse(
      format=m.format, leaves=[saved_leaf_to_pb(leaf) for leaf in m.leaves],
      shards=[record_to_pb(c) for c in m.shards])
  if m.data_state is not None:
    out.data_state_json = json.dumps(m.data_state)
  if m.extras:
    out.extras_json = json.dumps(dict(m.extras))
  if m.step is not None:
    out.step = m.step
  replicas_to_pb(out.replicas, m.replicas)
  return out


def manifest_from_pb(r: ckpt_pb.CheckpointInfoResponse) -> Manifest:
  try:
    extras = json.loads(r.extras_json) if r.extras_json else {}
    data_state = json.loads(r.data_state_json) if r.data_state_json else None
  except ValueError as e:
    raise errors.InvalidArgumentError(f"the manifest's JSON is not JSON: {e}") from None
  return Manifest(r.format, [leaf_info_from_pb(leaf, "leaf") for leaf in r.leaves],
                  [record_from_pb(c, "shard") for c in r.shards], data_state,
                  replicas_from_pb(r.replicas), extras=extras,
                  step=r.step if r.HasField("step") else None)


def arena_ref_to_pb(ref: codec.ArenaRef) -> pb.ArenaRef:
  return pb.ArenaRef(offset=ref.offset, nbytes=ref.nbytes, generation=ref.generation,
                     dtype=ref.dtype, shape=ref.shape)


def fill_data(target: ckpt_pb.ShardData, a: np.ndarray,
              to_arena: codec.ToArena | None = None) -> None:
  """Sets ``target`` to a shard's bytes: its arena block's ``ArenaRef`` where ``to_arena``
  gives one, else inline (set in place: building a message and copying it in would copy
  the bytes once more)."""
  a = codec.check_array(np.asarray(a), "shard")
  ref = to_arena(a) if to_arena is not None and a.nbytes else None
  if ref is not None:
    target.arena.CopyFrom(arena_ref_to_pb(ref))
    return
  target.array.dtype = a.dtype.name
  target.array.shape.extend(a.shape)
  target.array.data = a.tobytes()


def read_response_bytes(a: np.ndarray) -> bytes:
  """A serialized CheckpointReadResponse of the inline shard ``a``, its bytes copied once,
  into the answer (``fill_data`` then serializing copied them twice: ``tobytes`` and the
  message's own bytes)."""
  a = codec.check_array(np.asarray(a, order="C"), "shard")
  head = pb.Array(dtype=a.dtype.name, shape=a.shape).SerializeToString()
  if a.nbytes:
    head += _ARRAY_DATA_KEY + pbscan.encode_varint(a.nbytes)
  array = _SHARD_ARRAY_KEY + pbscan.encode_varint(len(head) + a.nbytes) + head
  data = _READ_DATA_KEY + pbscan.encode_varint(len(array) + a.nbytes) + array
  return b"".join([data, a.reshape(-1).view(np.uint8).data]) if a.nbytes else data


def _key(message: Any, field: str) -> bytes:
  """A length-delimited field's key of ``message``'s descriptor."""
  return pbscan.encode_varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


_ARRAY_DATA_KEY = _key(pb.Array, "data")
_SHARD_ARRAY_KEY = _key(ckpt_pb.ShardData, "array")
_READ_DATA_KEY = _key(ckpt_pb.CheckpointReadResponse, "data")


def data_from_pb(data: ckpt_pb.ShardData, from_arena: codec.FromArena | None, where: str,
                 views: Sequence[memoryview] | None = None) -> np.ndarray:
  """The array ``data`` carries: a view of its arena block (``from_arena``), or a copy.

  With ``views`` (a Stage request's on the sidecar, which only reads its shards), a
  read-only view instead of the copy: of its bytes where they arrived, where
  ``pbscan.strip_arrays`` left them, else of the one copy protobuf makes of them.
  """
  kind = data.WhichOneof("kind")
  if kind == "arena":
    r = data.arena
    ref = codec.ArenaRef(r.offset, r.nbytes, r.generation, r.dtype, tuple(r.shape))
    _check_size(ref.shape, codec.dtype_of(ref.dtype, where), ref.nbytes, where)
    if ref.nbytes <= 0:
      raise errors.InvalidArgumentError(
          f"{where}: an arena block needs nbytes > 0, got {ref.nbytes}; send it inline")
    if from_arena is None:
      raise errors.InvalidArgumentError(
          f"{where}: an arena block arrived but this side maps no arena")
    return from_arena(ref)
  if kind == "array":
    dtype = codec.dtype_of(data.array.dtype, where)
    shape = tuple(data.array.shape)
    payload: bytes | memoryview = data.array.data  # once: each read copies it out of protobuf
    if views:
      payload = pbscan.stripped(payload, list(views))
    _check_size(shape, dtype, len(payload), where)
    out = np.frombuffer(payload, dtype).reshape(shape)
    return out if views is not None else out.copy()
  raise errors.InvalidArgumentError(f"{where}: the shard's data is missing")


def _check_size(shape: tuple[int, ...], dtype: np.dtype, nbytes: int, where: str) -> None:
  if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
    raise errors.InvalidArgumentError(f"{where}: bad shape {list(shape)[:8]}")
  need = math.prod(shape) * dtype.itemsize
  if need != nbytes:
    raise errors.InvalidArgumentError(
        f"{where}: shape {list(shape)} of {dtype.name} needs {need} bytes, got {nbytes}")
