"""What a committed step's manifest says, as types: each saved leaf, each shard's checksum,
the data position saved with it, where its replicas went.

The same on both sides of the wire (``wire/checkpoint_wire``: the Info rpc); the file is
JSON (``server/checkpoint/save.StepWriter.commit`` writes it, ``server/checkpoint/read`` reads
it, or makes one for an item stock Orbax wrote).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar._src.ckptfmt.shards import ShardChecksum
from sidecar._src.ckptfmt.spec import KeyPath, LeafSpec


@dataclasses.dataclass(frozen=True, slots=True)
class SavedLeaf:
  """A leaf as its step saved it: a stock Orbax item tells no more than this (``kind``
  is then empty)."""
  key_path: KeyPath
  shape: tuple[int, ...]
  dtype: str  # the numpy name: "float32", "bfloat16"
  kind: str = ""

  @classmethod
  def of(cls, spec: LeafSpec) -> SavedLeaf:
    return cls(spec.key_path, spec.shape, spec.dtype.name, spec.kind.value)


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
  """A committed item's manifest: its leaves, its shards (their checksums, and the host
  that wrote each), the data position saved with it, and which peers held each host's
  replicas."""
  format: str
  leaves: tuple[SavedLeaf, ...]
  shards: tuple[ShardChecksum, ...]
  data_state: Any
  replicas: Mapping[int, Sequence[int]]
  dcp_plan: Mapping[str, Any] | None = None  # a DCP step's plan (sidecar/_src/torch/metadata)
