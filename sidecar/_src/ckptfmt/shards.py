"""The checksum a host reports for each shard it writes: crc32c of its C-order bytes.

Every format's writer takes the shards as staged (``records.StagedShard``) and returns
one ``records.ShardChecksum`` per shard written; the step's manifest keeps them.
"""

from __future__ import annotations

import crc32c
import numpy as np


def shard_crc32c(data: np.ndarray) -> int:
  """crc32c of an array's C-order bytes, as ``records.ShardChecksum`` records it."""
  # memoryview takes any ndarray; numpy declares __buffer__ only from Python 3.12 on.
  flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  return crc32c.crc32c(memoryview(flat))  # type: ignore[arg-type]
