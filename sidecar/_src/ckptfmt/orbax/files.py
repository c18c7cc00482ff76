"""The pieces of stock Orbax's layout that the write, commit and read paths share.

The item directory of a step, each array's TensorStore write spec (Orbax's own, so
its file names too), the name of a Zarr v2 chunk file, small files written durably, and
the key a sidecar's commit adds to the item's ``_METADATA`` (:data:`MANIFEST_KEY`).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from sidecar._src.ckptfmt import dir_fd, names, pinned
from sidecar._src.ckptfmt.orbax import libs
from sidecar._src.ckptfmt.spec import ITEM, TMP_SUFFIX, Index, LeafSpec
from sidecar._src.core import errors

if TYPE_CHECKING:
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

# The key a sidecar's commit adds to an item's ``_METADATA`` (stock Orbax reads past keys
# it does not know), its value the manifest's file name: an item that has it was written
# by a sidecar, so a restore that finds no manifest beside it refuses it (its checksums are
# gone) instead of reading it as a stock Orbax item, which has none.
MANIFEST_KEY = "sidecar_manifest"


def item_dir(step_dir: os.PathLike | str, *, must_be_tmp: bool) -> pathlib.Path:
  """The absolute path of the step's one item, ``default``; the step must be a tmp one
  where ``must_be_tmp``."""
  step_dir = pathlib.Path(step_dir)
  if must_be_tmp and not step_dir.name.endswith(TMP_SUFFIX):
    raise errors.InvalidArgumentError(
        f"{step_dir} is not an uncommitted step directory (name must end with"
        f" {TMP_SUFFIX!r}); create one with create_tmp_step()")
  if not step_dir.is_absolute():
    step_dir = step_dir.absolute()  # TensorStore needs absolute paths.
  return step_dir / ITEM


def check_unique(specs: Iterable[LeafSpec]) -> None:
  """Raises InvalidArgumentError where two leaves have the same parameter name."""
  seen = set()
  for spec in specs:
    if spec.param_name in seen:
      raise errors.InvalidArgumentError(f"leaf {spec.param_name!r} is given twice")
    seen.add(spec.param_name)


def write_spec(item_dir: pathlib.Path, spec: LeafSpec, host_index: int,
               use_compression: bool) -> ts_utils.ArrayWriteSpec:
  """Orbax's own TensorStore spec (and chunk shape, file names) for a leaf, as host
  ``host_index`` writes it: Zarr v2, no OCDBT."""
  # Orbax loads with the first checkpoint (a sidecar starts without it).
  libs.load()  # once, for the process: never raced
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  leaf_dir(item_dir, spec.param_name)
  return ts_utils.ArrayWriteSpec(
      item_dir.as_posix(), spec.param_name, global_shape=spec.shape,
      write_shape=spec.write_shape, dtype=spec.dtype, use_ocdbt=False,
      use_zarr3=False, use_compression=use_compression, process_id=host_index)


def chunk_shape(shape: Sequence[int], write_shape: Sequence[int], dtype: np.dtype
                ) -> tuple[int, ...]:
  """The chunk shape Orbax's write spec gives a leaf of ``shape`` written in blocks of
  ``write_shape`` (one chunk per block, blocks over 2 GiB split): what a save's
  ``.zarray`` says. Computed, no file touched."""
  libs.load()  # once, for the process: never raced
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  return tuple(ts_utils.ArrayWriteSpec(
      "/", "leaf", global_shape=tuple(shape), write_shape=tuple(write_shape), dtype=dtype,
      use_ocdbt=False, use_zarr3=False, use_compression=False, process_id=0
  ).metadata.chunk_shape)


def leaf_dir(item_dir: pathlib.Path, param_name: str) -> pathlib.Path:
  """The directory of a leaf's array in ``item_dir``: ``param_name`` checked to be a name,
  and the path, resolved, to lie beneath ``item_dir`` (TensorStore opens it by path, so a
  symlink on the way is refused here first)."""
  names.check_name(param_name, "leaf", fix="leaf keys are names: no '/' at the start, no "
                   "'.'/'..' component, no NUL")
  return names.check_beneath(item_dir, item_dir / param_name, f"leaf {param_name!r}")


def whole_chunk(index: Index, chunk: Sequence[int], separator: str = ".") -> str | None:
  """The name of the Zarr v2 chunk file that holds exactly the block ``index``; None
  where the block is not one whole chunk (or is a scalar, which TensorStore keeps)."""
  if (not chunk or len(chunk) != len(index)
      or any(b - a != c or a % c for (a, b), c in zip(index, chunk))):
    return None
  return separator.join(str(a // c) for (a, _), c in zip(index, chunk))


def write_text(path: pathlib.Path, text: str, *, sync: bool = True) -> None:
  """Writes a small file durably (``sync=False``: not synced, for one written again
  before the commit); its directory is synced before the commit. The file is opened in
  its directory, made where missing, each reached without following a symlink (only a
  trusted one on the way to the directory: ``names.py``, ``dir_fd.DirFd.at``)."""
  with dir_fd.DirFd.at(path.parent, make=True) as d:
    fd = names.open_at(d.fd, path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                       shown=d.path)
  with os.fdopen(fd, "w") as f:
    f.write(text)
    if sync:
      f.flush()
      os.fsync(f.fileno())


def write_text_beneath(item: pinned.Pinned, name: str, text: str) -> None:
  """:func:`write_text` of ``name`` beneath a pinned directory (its directories made)."""
  fd = item.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, make_dirs=True)
  with os.fdopen(fd, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
