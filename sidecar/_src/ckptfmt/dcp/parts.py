"""The typed parts a DCP save carries: a rank's item count at Stage, what commits it at Commit.

Frozen values, the same on both sides of the wire (``wire/checkpoint_wire.py`` converts
them); no torch, no pickle loaded.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping
from typing import Any

from sidecar._src.ckptfmt import names
from sidecar._src.ckptfmt.dcp.distcp import file_name
from sidecar._src.core import errors


@dataclasses.dataclass(frozen=True, slots=True)
class DcpPart:
  """One rank's part of a DCP step: its rank and how many items it has, the same in each
  of its Stages. Each item is described by its shard's record alone, numbered by the
  record's ``leaf`` in the order of the rank's file (``distcp.Item.of_record``): nothing
  here describes an item a second time.
  """

  rank: int
  item_count: int

  def __post_init__(self) -> None:
    for name in ("rank", "item_count"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise errors.InvalidArgumentError(f"dcp.{name} must be an int >= 0, got {value!r:.100}")


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

  def check_plan(self, where: str = "dcp.plan_json") -> None:
    """InvalidArgumentError unless every storage entry of the plan names, as its file, one
    of the ranks' files this commit writes (``__<rank>_0.distcp``): a name, never a path
    (a read from storage opens that file in the checkpoint's directory)."""
    plan = self.plan()
    storage = plan.get("storage") if isinstance(plan, dict) else None
    if not isinstance(storage, list) or not all(isinstance(s, dict) for s in storage):
      raise errors.InvalidArgumentError(
          f"{where}: 'storage' must be a list of entries, got {storage!r:.100}")
    files = {file_name(rank) for rank in self.file_sizes}
    for i, s in enumerate(storage):
      path = names.check_name(s.get("path"), f"{where} storage[{i}].path",
                              fix="an item lies in one of the ranks' files, named as DCP names "
                              "them (__<rank>_0.distcp)")
      if path not in files:
        raise errors.InvalidArgumentError(
            f"{where} storage[{i}].path {path!r:.200} is none of the ranks' files of this "
            f"commit ({', '.join(sorted(files)) or 'none'}); an item lies in its rank's file")
