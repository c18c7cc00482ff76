"""PyTorch DCP's on-disk layout, written by sidecars (``.metadata``, ``__{rank}_0.distcp``).

* ``distcp``: the files: items, placements, each rank's file, reads.
* ``commit``: the uncommitted directory, made by a save, and its commit (one swap or rename).
* ``archive``: one tensor chunk as ``torch.save`` stores it, an archive byte for byte.
* ``parts``: the typed parts a DCP save carries (``DcpPart``: a rank and its item count, each
  item its shard record; ``DcpCommit``).
* ``format``: :class:`~sidecar._src.ckptfmt.dcp.format.DcpFormat`, the format seam's
  implementation (``ckptfmt/format.py``).

None imports torch, Orbax, TensorStore or JAX. The names below are ``distcp``'s and
``commit``'s, as the trainer's DCP adapter (``sidecar/_src/torch``) imports them from
``ckptfmt.dcp``.
"""

from sidecar._src.ckptfmt.dcp.commit import (
  OLD_SUFFIX,
  create_tmp,
  finalize,
  old_path,
  recover,
  tmp_path,
)
from sidecar._src.ckptfmt.dcp.distcp import (
  FORMAT,
  METADATA_FILE,
  TMP_SUFFIX,
  Item,
  ItemKind,
  Placement,
  data_offset,
  file_name,
  is_checkpoint,
  layout,
  read_item,
  write_rank_part,
)
from sidecar._src.ckptfmt.dcp.parts import DcpCommit, DcpPart

__all__ = [
  "FORMAT", "METADATA_FILE", "OLD_SUFFIX", "TMP_SUFFIX", "DcpCommit", "DcpPart", "Item",
  "ItemKind", "Placement", "create_tmp", "data_offset", "file_name", "finalize",
  "is_checkpoint", "layout", "old_path", "read_item", "recover", "tmp_path",
  "write_rank_part",
]
