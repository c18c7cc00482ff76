"""What a registered pipeline is told about its place in the job."""

from __future__ import annotations

import dataclasses
import os

from sidecar._src.user import data_paths, data_roots


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PipelineContext:
  """Passed as the first argument of every ``@sidecar.pipeline`` function.

  A pipeline that returns a Grain ``MapDataset`` can ignore the shard fields: the
  framework then shards, shuffles (by ``seed`` and ``epoch``) and positions it
  globally itself. A pipeline that returns any other iterable must yield only its
  own shard's elements (``shard_index`` of ``shard_count``) starting after the
  first ``position`` of them, so that it can resume.

  A pipeline that takes paths among its arguments opens each through :meth:`data_path`:
  in a pool, it reads only beneath its tenant's data roots (docs/pool.md).

  Attributes:
    shard_index: which shard of the data this pipeline instance produces.
    shard_count: how many shards there are in all.
    seed: the feed's seed; equal seeds give equal streams.
    epoch: the epoch being produced, from 0.
    position: elements of this shard (in this epoch) already consumed; start after them.
    data_roots: where its files may be (the feed's tenant's data roots in a pool;
      anywhere the sidecar may read outside one).
  """
  shard_index: int
  shard_count: int
  seed: int = 0
  epoch: int = 0
  position: int = 0
  data_roots: data_roots.DataRoots = dataclasses.field(default=data_roots.ANYWHERE,
                                                       repr=False)

  def data_path(self, path: str | os.PathLike) -> data_paths.DataPath:
    """``path`` (a file, a directory or a glob, from the pipeline's arguments) as this
    feed may read it: :meth:`~sidecar.DataPath.open`, ``/ name``,
    :meth:`~sidecar.DataPath.expand`, :meth:`~sidecar.DataPath.view`.

    In a pool, only beneath its tenant's data roots: a path outside them is refused here,
    before anything is looked up, and no symlink or ``..`` below them leads out.

    Raises:
      PermissionDeniedError: in a pool, ``path`` lies under none of the tenant's data
        roots (naming them, and the pool file's line).
    """
    return data_paths.DataPath(path, self.data_roots)

  def __post_init__(self):
    if not 0 <= self.shard_index < self.shard_count:
      raise ValueError(f"shard_index must be in [0, shard_count={self.shard_count}), "
                       f"got {self.shard_index!r}")
    if self.position < 0 or self.epoch < 0:
      raise ValueError(f"position and epoch must be >= 0, got {self.position!r}, {self.epoch!r}")
