"""The one tree library is ``core/trees.py`` (issue 36): this name stays only until
``torch/framework.py`` imports that module; then this file goes."""

from sidecar._src.core.trees import (
  IsLeaf as IsLeaf,
  TreeDef as TreeDef,
  flatten as flatten,
  flatten_with_path as flatten_with_path,
  leaves as leaves,
  unflatten as unflatten,
)
