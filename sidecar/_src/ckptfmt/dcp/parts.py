"""The typed parts a DCP save carries: a rank's items at Stage, what commits it at Commit.

Frozen values, the same on both sides of the wire (``wire/checkpoint_wire.py`` converts
them); no torch, no pickle loaded.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar._src.ckptfmt.dcp.distcp import Item
from sidecar._src.core import errors


@dataclasses.dataclass(frozen=True, slots=True)
class DcpPart:
  """One rank's items, in the order of its file (a staged shard's ``leaf`` numbers them)."""

  rank: int
  items: tuple[Item, ...]

  def __post_init__(self) -> None:
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
      raise errors.InvalidArgumentError(f"dcp.rank must be an int >= 0, got {self.rank!r:.100}")
    object.__setattr__(self, "items", tuple(self.items))

  @classmethod
  def of(cls, rank: int, items: Sequence[Item | Mapping[str, Any]]) -> DcpPart:
    """From items or their ``Item.to_dict`` values (the trainer's form until it sends Items)."""
    return cls(rank, tuple(i if isinstance(i, Item) else Item.from_dict(i) for i in items))


@dataclasses.dataclass(frozen=True, slots=True)
class DcpCommit:
  """What commits a DCP checkpoint, besides the checksums.

  Attributes:
    metadata: DCP's ``Metadata`` as rank 0's trainer pickled it: written as is, never loaded.
    file_sizes: every rank's file size, by rank.
    plan_json: the same metadata as plain values (``sidecar/_src/torch/metadata.to_plan``),
      kept in the manifest: a restore needs no pickle, a read from storage finds each item.
  """

  metadata: bytes
  file_sizes: Mapping[int, int]
  plan_json: str

  def __post_init__(self) -> None:
    object.__setattr__(self, "file_sizes", types.MappingProxyType(
        {int(r): int(n) for r, n in self.file_sizes.items()}))

  def plan(self) -> Any:
    """The plan, parsed; InvalidArgumentError if it is not JSON."""
    try:
      return json.loads(self.plan_json)
    except ValueError as e:
      raise errors.InvalidArgumentError(f"dcp.plan_json is not JSON: {e}") from None
