"""The checkpoint protocol's messages (``protos/sidecar/v1/checkpoint.proto``) <-> values.

Both sides of the ``Checkpoint`` service use these: the controller's client
(``controller/checkpoint/client.py``) and the sidecar's servicer
(``server/checkpoint/service.py``). Every ``*_from_pb`` checks what the message cannot say
itself (an interval's order, a dtype on the allow-list) and raises InvalidArgumentError
naming the field. Inside each
side, leaf specs and checksums are ``ckptfmt``'s frozen types (``LeafSpec``,
``ShardChecksum``); a manifest read from a file stays the dict the file holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from sidecar._src.ckptfmt import spec as layout
from sidecar._src.ckptfmt.manifest import SavedLeaf
from sidecar._src.ckptfmt.shards import ShardChecksum
from sidecar._src.ckptfmt.spec import Index, KeyPath, LeafSpec
from sidecar._src.core import errors
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import ckpt_pb, pb

# Read tiers by name, as the Checkpointer and the sidecar's RAM tier say them.
TIERS = {"any": ckpt_pb.TIER_ANY, "ram": ckpt_pb.TIER_RAM, "replica": ckpt_pb.TIER_REPLICA,
         "disk": ckpt_pb.TIER_DISK}
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
  return ckpt_pb.ShardId(key_path=key_path_to_pb(kp), index=index_to_pb(index))


def shard_from_pb(shard: ckpt_pb.ShardId, where: str) -> tuple[KeyPath, Index]:
  return (key_path_from_pb(shard.key_path, f"{where}.key_path"),
          index_from_pb(shard.index, f"{where}.index"))


def shard_ids(shards: Iterable[tuple[Any, Any]]) -> ckpt_pb.ShardIds:
  """``[(key_path, index), ...]`` (as ``CheckpointHost.ram`` lists them) as a message."""
  return ckpt_pb.ShardIds(shards=[shard_to_pb(kp, index) for kp, index in shards])


def shards_from_ids(ids: ckpt_pb.ShardIds, where: str) -> list[tuple[KeyPath, Index]]:
  return [shard_from_pb(s, where) for s in ids.shards]


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
                    kind=layout.LeafKind(leaf.kind), write_shape=tuple(leaf.write_shape),
                    sharding=leaf.sharding if leaf.HasField("sharding") else None)
  except (ValueError, TypeError) as e:  # LeafKind("bad"), say
    raise errors.InvalidArgumentError(f"{where}: {e}") from None


def manifest_leaf_to_pb(d: Mapping[str, Any]) -> ckpt_pb.LeafSpec:
  """A leaf of a manifest file (``layout.spec_to_dict``'s, or ``read.item_leaves``' for an
  item stock Orbax wrote, with fewer fields)."""
  out = ckpt_pb.LeafSpec(key_path=key_path_to_pb(d["key_path"]), shape=list(d["shape"]),
                         dtype=str(d["dtype"]), kind=str(d.get("kind") or ""),
                         write_shape=list(d.get("write_shape") or ()))
  if d.get("sharding") is not None:
    out.sharding = d["sharding"]
  return out


def leaf_info_from_pb(leaf: ckpt_pb.LeafSpec, where: str) -> SavedLeaf:
  """A saved leaf's key path, shape and dtype (a stock Orbax item tells no more)."""
  return SavedLeaf(key_path_from_pb(leaf.key_path, f"{where}.key_path"),
                   tuple(int(d) for d in leaf.shape), codec.dtype_of(leaf.dtype, where).name,
                   leaf.kind)


def checksum_to_pb(c: ShardChecksum) -> ckpt_pb.ShardChecksum:
  out = ckpt_pb.ShardChecksum(shard=shard_to_pb(c.key_path, c.index), nbytes=c.nbytes)
  if c.crc32c is not None:
    out.crc32c = c.crc32c
  if c.host is not None:
    out.host = c.host
  return out


def checksum_from_pb(c: ckpt_pb.ShardChecksum, where: str) -> ShardChecksum:
  kp, index = shard_from_pb(c.shard, f"{where}.shard")
  return ShardChecksum(kp, index, c.nbytes, c.crc32c if c.HasField("crc32c") else None,
                       c.host if c.HasField("host") else None)


def dcp_part_to_pb(rank: int, items: Iterable[Mapping[str, Any]]) -> ckpt_pb.DcpPart:
  """A rank's part of a DCP step (``ckptfmt/dcp.Item.to_dict`` values) as its message."""
  return ckpt_pb.DcpPart(rank=rank, items=[
      ckpt_pb.DcpItem(fqn=d["fqn"], kind=d["kind"], nbytes=d["nbytes"], dtype=d.get("dtype", ""),
                      sizes=d.get("sizes", ()), offsets=d.get("offsets", ())) for d in items])


def dcp_part_from_pb(part: ckpt_pb.DcpPart, where: str) -> dict[str, Any]:
  """``{"rank", "items"}``, the items as ``ckptfmt/dcp.Item.from_dict`` takes them."""
  items = []
  for i, m in enumerate(part.items):
    if m.kind not in ("tensor", "bytes") or not m.fqn:
      raise errors.InvalidArgumentError(
          f"{where}.items[{i}]: kind must be 'tensor' or 'bytes' with an fqn, got "
          f"{m.kind!r} {m.fqn!r:.100}")
    items.append({"fqn": m.fqn, "kind": m.kind, "nbytes": m.nbytes, "dtype": m.dtype,
                  "sizes": list(m.sizes), "offsets": list(m.offsets)})
  return {"rank": part.rank, "items": items}


def replicas_to_pb(target, placement: Mapping[Any, Iterable[int]] | None) -> None:
  """Fills the map ``target`` (host -> HostIds) from ``{host: [peers]}``."""
  for h, peers in (placement or {}).items():
    target[int(h)].hosts.extend(int(p) for p in peers)


def replicas_from_pb(source) -> dict[int, list[int]]:
  return {int(h): list(v.hosts) for h, v in source.items()}


def fill_data(target: ckpt_pb.ShardData, a: np.ndarray,
              to_arena: codec.ToArena | None = None) -> None:
  """Sets ``target`` to a shard's bytes: its arena block's descriptor where ``to_arena``
  gives one, else inline (set in place: building a message and copying it in would copy
  the bytes once more)."""
  a = codec.check_array(np.asarray(a), "shard")
  ref = to_arena(a) if to_arena is not None and a.nbytes else None
  if ref is not None:
    target.arena.CopyFrom(pb.ArenaRef(offset=ref.offset, nbytes=ref.nbytes,
                                      generation=ref.generation, dtype=ref.dtype,
                                      shape=ref.shape))
    return
  target.array.dtype = a.dtype.name
  target.array.shape.extend(a.shape)
  target.array.data = a.tobytes()


def data_from_pb(data: ckpt_pb.ShardData, from_arena: codec.FromArena | None, where: str
                 ) -> np.ndarray:
  """The array ``data`` carries: a view of its arena block (``from_arena``), or a copy."""
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
    _check_size(shape, dtype, len(data.array.data), where)
    return np.frombuffer(data.array.data, dtype).reshape(shape).copy()
  raise errors.InvalidArgumentError(f"{where}: the shard's data is missing")


def _check_size(shape: tuple[int, ...], dtype: np.dtype, nbytes: int, where: str) -> None:
  if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
    raise errors.InvalidArgumentError(f"{where}: bad shape {list(shape)[:8]}")
  need = math.prod(shape) * dtype.itemsize
  if need != nbytes:
    raise errors.InvalidArgumentError(
        f"{where}: shape {list(shape)} of {dtype.name} needs {need} bytes, got {nbytes}")
