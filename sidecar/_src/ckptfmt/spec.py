"""The names and leaf specs of a checkpoint in stock Orbax's layout: what the controller
and the sidecars both need, with no TensorStore, Orbax or framework import.

The rest of ``ckptfmt`` writes and reads the files; this module says what they are called
and describes the leaves (:class:`LeafSpec`), so that a controller that only plans saves
and restores loads neither TensorStore nor ``orbax.checkpoint`` (about 1.5 s of
``import sidecar``), nor JAX. Names are Orbax's own, byte for byte
(tests/unit/ckptfmt/test_spec.py compares them with Orbax's); the JAX adapter
(``jax/checkpoint.py``) names a JAX tree's leaves and serializes its shardings as Orbax does.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from sidecar._src.core import dtypes as dtypes_lib, errors
from sidecar._src.core.trees import KeyPath

ITEM = "default"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax atomicity_types.TMP_DIR_SUFFIX
COMMIT_SUCCESS_FILE = "commit_success.txt"  # orbax atomicity_types.COMMIT_SUCCESS_FILE
METADATA_FILE = "_METADATA"
SHARDING_FILE = "_sharding"

Index = tuple[tuple[int, int], ...]


def shard_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
  """A shard's index as ``((start, stop), ...)`` per dimension."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class LeafKind(enum.StrEnum):
  """How Orbax saved a leaf, and so what it restores it as."""

  JAX_ARRAY = "jax.Array"
  NUMPY = "np.ndarray"
  SCALAR = "scalar"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeafSpec:
  """One array leaf of the checkpointed tree; the same on every host.

  Attributes:
    key_path: the leaf's path in the tree; ``str`` entries are dict keys, ``int``
      entries sequence indices (``("opt", 0, "mu")``).
    shape: global shape.
    dtype: numpy dtype (``ml_dtypes.bfloat16`` included).
    kind: what stock Orbax restores the leaf as.
    write_shape: the shape of one shard, the Zarr chunk every host writes in
      (``sharding.shard_shape(shape)``); defaults to ``shape`` (unsharded).
    sharding: Orbax's serialized sharding (``jax/checkpoint.serialized_sharding``), stored in
      ``_sharding`` so that a restore without target shardings can rebuild it.
  """

  key_path: KeyPath
  shape: tuple[int, ...]
  dtype: np.dtype
  kind: LeafKind = LeafKind.JAX_ARRAY
  write_shape: tuple[int, ...] | None = None
  sharding: str | None = None

  def __post_init__(self) -> None:
    if not self.key_path or not all(isinstance(k, (str, int)) for k in self.key_path):
      raise errors.InvalidArgumentError(
          f"key_path must be a non-empty tuple of str/int, got {self.key_path!r}")
    object.__setattr__(self, "key_path", tuple(self.key_path))
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    object.__setattr__(self, "dtype", np.dtype(self.dtype))
    object.__setattr__(self, "kind", LeafKind(self.kind))
    if 0 in self.shape:
      raise errors.InvalidArgumentError(
          f"leaf {self.param_name!r} has zero-size shape {self.shape}; Orbax stores no chunk"
          " for it, leave it out of the checkpoint")
    write_shape = self.shape if self.write_shape is None else tuple(self.write_shape)
    if len(write_shape) != len(self.shape) or any(
        not 0 < w <= max(s, 1) for w, s in zip(write_shape, self.shape)):
      raise errors.InvalidArgumentError(
          f"write_shape of {self.param_name!r} must be a shard shape of {self.shape},"
          f" got {write_shape}")
    object.__setattr__(self, "write_shape", write_shape)
    if self.kind is LeafKind.SCALAR and self.shape:
      raise errors.InvalidArgumentError(
          f"scalar leaf {self.param_name!r} must have shape (), got {self.shape}")

  @property
  def param_name(self) -> str:
    """Orbax's name for the leaf: its keys joined by dots."""
    return ".".join(str(k) for k in self.key_path)

  @classmethod
  def from_value(cls, key_path: KeyPath, value: Any) -> LeafSpec:
    """Describes a numpy array or an int/float scalar (a framework's arrays: its adapter,
    e.g. ``jax/checkpoint.leaf_spec``).

    Runs where the value lives (the worker); only the returned spec crosses to
    the sidecar.
    """
    if isinstance(value, np.ndarray):
      return cls(key_path=tuple(key_path), shape=value.shape, dtype=value.dtype,
                 kind=LeafKind.NUMPY)
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
      return cls(key_path=tuple(key_path), shape=(), dtype=np.asarray(value).dtype,
                 kind=LeafKind.SCALAR)
    raise errors.InvalidArgumentError(
        f"leaf {key_path!r}: cannot checkpoint a {type(value).__name__}; expected a"
        " numpy array or int/float scalar")


def spec_to_dict(s: LeafSpec) -> dict[str, Any]:
  """A LeafSpec as plain values (what crosses between controller and sidecars)."""
  return {"key_path": list(s.key_path), "shape": list(s.shape), "dtype": s.dtype.name,
          "kind": str(s.kind), "write_shape": list(s.write_shape),  # type: ignore[arg-type]
          "sharding": s.sharding}


def spec_from_dict(d: Mapping[str, Any]) -> LeafSpec:
  return LeafSpec(key_path=tuple(d["key_path"]), shape=tuple(d["shape"]),
                  dtype=dtypes_lib.dtype_of(d["dtype"], f"leaf {d['key_path']}"), kind=d["kind"],
                  write_shape=tuple(d["write_shape"]), sharding=d.get("sharding"))


def tmp_step_path(directory: os.PathLike | str, step: int) -> pathlib.Path:
  """Where a step is written before its commit, as Orbax names it."""
  return pathlib.Path(directory) / f"{int(step)}{TMP_SUFFIX}"
