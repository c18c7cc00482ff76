"""What a host writes into a step, and the checksum it reports: values, no Orbax.

``write`` takes :class:`HostLeaf` values and returns one :class:`ShardChecksum`
per shard written; the step's manifest keeps the checksums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import crc32c
import numpy as np

from sidecar._src.ckptfmt.spec import Index, KeyPath, LeafSpec


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
  """One block of a leaf: where it sits in the global array, and its bytes.

  ``index`` takes slices or ``(start, stop)`` pairs (``jax`` ``Shard.index`` works
  as is) and is stored as ``(start, stop)`` pairs once a leaf resolves it.
  """

  index: tuple[slice | tuple[int, int], ...]
  data: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class HostLeaf:
  """A leaf and the shards of it this host writes (possibly none)."""

  spec: LeafSpec
  shards: tuple[Shard, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "shards", tuple(self.shards))


@dataclasses.dataclass(frozen=True, slots=True)
class ShardChecksum:
  """The crc32c of one written shard's C-order bytes, for the step's manifest.

  The same value on both sides of the wire (``wire/checkpoint_wire.checksum_to_pb``);
  a dict only in a manifest file (``to_dict``/``from_dict``) or JSON between processes.
  """

  key_path: KeyPath
  index: Index
  nbytes: int
  crc32c: int | None  # None: a leaf stock Orbax wrote, nothing to check
  host: int | None = None  # the host that wrote it; None: not known (stock Orbax)

  def to_dict(self) -> dict[str, Any]:
    """The manifest's entry for this shard."""
    return {"key_path": list(self.key_path), "index": [list(i) for i in self.index],
            "nbytes": self.nbytes, "crc32c": self.crc32c, "host": self.host}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ShardChecksum:
    return cls(tuple(d["key_path"]), tuple((int(a), int(b)) for a, b in d["index"]),
               int(d.get("nbytes") or 0), None if d.get("crc32c") is None else int(d["crc32c"]),
               None if d.get("host") is None else int(d["host"]))


def shard_crc32c(data: np.ndarray) -> int:
  """crc32c of an array's C-order bytes, as :class:`ShardChecksum` records it."""
  # memoryview takes any ndarray; numpy declares __buffer__ only from Python 3.12 on.
  flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  return crc32c.crc32c(memoryview(flat))  # type: ignore[arg-type]
