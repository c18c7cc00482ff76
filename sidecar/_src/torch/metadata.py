"""DCP's ``Metadata``, in the trainer: pickled for ``.metadata``, and carried in our own form.

Rank 0's ``StorageWriter.finish`` holds DCP's ``Metadata``; :func:`finish` completes it
as ``FileSystemWriter`` does (``storage_data`` from every rank's write results, the
version, the storage meta) and pickles it here, in the trainer, for the sidecar to write
as opaque bytes (``ckptfmt/dcp/distcp.py`` says why the sidecar never pickles).

:func:`to_plan` writes the same metadata as plain JSON values (the plan: every item's
dtype, size and chunks, where each is stored, DCP's planner data where it is the
default planner's mapping of keys to paths), kept in the checkpoint's manifest and in
the sidecars' RAM tier; :func:`from_plan` rebuilds ``Metadata`` from it. A restore from
the RAM tier, where no file is read, so unpickles nothing.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from sidecar._src.ckptfmt.dcp import distcp
from sidecar._src.core import errors
from sidecar._src.torch import tensors

VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION
PLAN_VERSION = 1


def item_of(write_item: WriteItem, nbytes: int) -> distcp.Item:
  """Our item of one of DCP's write items (``nbytes``: the bytes of a resolved bytes item);
  its shard's record is ``Item.record``."""
  fqn = write_item.index.fqn
  if write_item.type == WriteItemType.BYTE_IO:
    return distcp.Item(fqn=fqn, kind=distcp.ItemKind.BYTES, nbytes=nbytes)
  data = write_item.tensor_data
  if data is None:
    raise errors.InvalidArgumentError(f"write item {fqn!r} is a tensor with no tensor data")
  dtype = tensors.dtype_name(data.properties.dtype, f"state dict entry {fqn!r}")
  sizes = tuple(int(s) for s in data.chunk.sizes)
  return distcp.Item(fqn=fqn, kind=distcp.ItemKind.TENSOR, nbytes=nbytes, dtype=dtype, sizes=sizes,
                  offsets=tuple(int(o) for o in data.chunk.offsets))


def write_results(rank: int, write_items: Sequence[WriteItem], items: Sequence[distcp.Item]
                  ) -> list[WriteResult]:
  """DCP's write results of rank ``rank``'s items: where :func:`distcp.layout` puts each."""
  placements, _ = distcp.layout(rank, items)
  return [WriteResult(index=w.index, size_in_bytes=p.length,
                      storage_data=_StorageInfo(p.relative_path, p.offset, p.length))
          for w, p in zip(write_items, placements)]


def file_sizes(results: Sequence[Sequence[WriteResult]]) -> dict[str, int]:
  """Every file's size, from every rank's write results: its last item's end."""
  sizes: dict[str, int] = {}
  for per_rank in results:
    for r in per_rank:
      info = r.storage_data
      sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
  return sizes


def finish(metadata: dcp_metadata.Metadata, results: Sequence[Sequence[WriteResult]], *,
           checkpoint_id: str, save_id: str) -> bytes:
  """Completes ``metadata`` as DCP's ``FileSystemWriter.finish`` does, and pickles it."""
  metadata.version = VERSION
  metadata.storage_data = {r.index: r.storage_data for per_rank in results for r in per_rank}
  metadata.storage_meta = dcp_metadata.StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
  return pickle.dumps(metadata)


def _path(value: Any) -> list[str | int] | None:
  if isinstance(value, (tuple, list)) and all(
      isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
    return list(value)
  return None


def to_plan(metadata: dcp_metadata.Metadata) -> dict[str, Any]:
  """The metadata as JSON values (see the module docstring)."""
  state: dict[str, Any] = {}
  for fqn, entry in metadata.state_dict_metadata.items():
    if isinstance(entry, dcp_metadata.BytesStorageMetadata):
      state[fqn] = {"kind": "bytes"}
    else:
      state[fqn] = {
          "kind": "tensor", "dtype": tensors.dtype_name(entry.properties.dtype, repr(fqn)),
          "requires_grad": bool(entry.properties.requires_grad), "size": list(entry.size),
          "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)}
                     for c in entry.chunks]}
  storage = []
  for index, info in (metadata.storage_data or {}).items():
    if not isinstance(info, _StorageInfo) or info.transform_descriptors:
      raise errors.InvalidArgumentError(
          f"storage entry of {index.fqn!r} is not a plain file record: {info!r:.100}")
    storage.append({"fqn": index.fqn, "offset": None if index.offset is None
                    else list(index.offset), "index": index.index,
                    "path": info.relative_path, "at": info.offset, "length": info.length})
  planner = metadata.planner_data
  paths = ({k: _path(v) for k, v in planner.items()} if isinstance(planner, dict) else None)
  if paths is not None and any(v is None for v in paths.values()):
    paths = None
  meta = metadata.storage_meta
  return {"version": PLAN_VERSION, "dcp_version": metadata.version, "state": state,
          "storage": storage, "planner_data": paths,
          "checkpoint_id": None if meta is None or meta.checkpoint_id is None
          else str(meta.checkpoint_id), "save_id": None if meta is None else meta.save_id}


def from_plan(plan: Mapping[str, Any]) -> dcp_metadata.Metadata:
  """DCP's ``Metadata`` rebuilt from :func:`to_plan`'s values; nothing unpickled."""
  if plan.get("version") != PLAN_VERSION:
    raise errors.InvalidArgumentError(
        f"checkpoint plan version {plan.get('version')!r}, expected {PLAN_VERSION}")
  state: dict[str, dcp_metadata.STORAGE_TYPES] = {}
  for fqn, entry in plan["state"].items():
    if entry["kind"] == "bytes":
      state[fqn] = dcp_metadata.BytesStorageMetadata()
      continue
    props = dcp_metadata.TensorProperties(dtype=tensors.torch_dtype(entry["dtype"], repr(fqn)),
                                requires_grad=bool(entry.get("requires_grad", False)))
    state[fqn] = dcp_metadata.TensorStorageMetadata(
        props, torch.Size(entry["size"]),
        [dcp_metadata.ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
         for c in entry["chunks"]])
  storage = {dcp_metadata.MetadataIndex(s["fqn"], s["offset"], s["index"]):
             _StorageInfo(s["path"], s["at"], s["length"]) for s in plan["storage"]}
  planner = plan.get("planner_data")
  return dcp_metadata.Metadata(
      state_dict_metadata=state,
      planner_data=None if planner is None else {k: tuple(v) for k, v in planner.items()},
      storage_data=storage, version=plan.get("dcp_version"),
      storage_meta=dcp_metadata.StorageMeta(checkpoint_id=plan.get("checkpoint_id"),
                                  save_id=plan.get("save_id")))
