"""What a host writes into a step, and the checksum it reports: values, no Orbax.

``write`` takes :class:`HostLeaf` values and returns one :class:`ShardChecksum`
per shard written; the step's manifest keeps the checksums.
"""

from __future__ import annotations

import dataclasses

import crc32c
import numpy as np

from sidecar._src.ckptfmt.spec import LeafSpec


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

  def __post_init__(self) -> None:
    object.__setattr__(self, "shards", tuple(self.shards))


def shard_crc32c(data: np.ndarray) -> int:
  """crc32c of an array's C-order bytes, as :class:`ShardChecksum` records it."""
  # memoryview takes any ndarray; numpy declares __buffer__ only from Python 3.12 on.
  flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  return crc32c.crc32c(memoryview(flat))  # type: ignore[arg-type]
