"""The checksum a host reports for each shard it writes: crc32c of its C-order bytes.

Every format's writer takes the shards as staged (``records.Staged``: a record, its bytes
beside it) and returns each record written (``ShardRecord.with_crc32c``); the
step's manifest lists them.
"""

from __future__ import annotations

import crc32c
import numpy as np

from sidecar._src.ckptfmt.records import MANIFEST_FILE, ShardId
from sidecar._src.core import errors


def shard_crc32c(data: np.ndarray) -> int:
  """crc32c of an array's C-order bytes, as ``records.ShardRecord.crc32c`` records it."""
  # memoryview takes any ndarray; numpy declares __buffer__ only from Python 3.12 on.
  flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  return crc32c.crc32c(memoryview(flat))  # type: ignore[arg-type]


def check(final_dir: str, shard: ShardId, data: np.ndarray, crc32c: int, what: str) -> None:
  """CorruptCheckpointError unless ``data`` (the ``what`` of a shard) has ``crc32c``."""
  if shard_crc32c(data) != crc32c:
    name = ".".join(str(k) for k in shard.key_path)
    raise errors.CorruptCheckpointError(
        f"{final_dir}: array {name!r} shard {[list(i) for i in shard.index]} does not match "
        f"its crc32c in {MANIFEST_FILE} ({what}): the file is corrupt or was changed after the "
        "save")
