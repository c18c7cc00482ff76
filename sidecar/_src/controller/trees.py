"""Pytrees of the codec's containers, with no framework: flatten, unflatten, key paths.

The controller core walks the trees a sidecar sends (dict, list, tuple, namedtuple,
None, with arrays and scalars as leaves) without ``jax.tree_util``, which a PyTorch
trainer does not have. It walks them the way ``jax.tree_util`` does: dict keys in sorted order,
None as an empty node. A framework's own trees (registered JAX pytrees, dataclasses)
are its adapter's to flatten; their key paths must stay what stock Orbax names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sidecar._src.ckptfmt.spec import KeyPath

IsLeaf = Callable[[Any], bool]


@dataclasses.dataclass(frozen=True, slots=True)
class TreeDef:
  """The structure of a flattened tree: ``kind`` is "leaf", "none", "dict", "list" or
  "tuple"; ``keys`` a dict's keys, in the order of ``children``; ``tuple_type`` a
  namedtuple's class (a tuple's, None)."""
  kind: str
  children: tuple[TreeDef, ...] = ()
  keys: tuple[Any, ...] = ()
  tuple_type: type | None = None

  @property
  def num_leaves(self) -> int:
    if self.kind == "leaf":
      return 1
    return sum(c.num_leaves for c in self.children)


_LEAF = TreeDef("leaf")
_NONE = TreeDef("none")


def _sorted_keys(d: dict) -> list:
  try:
    return sorted(d)
  except TypeError:  # keys of mixed types: their order in the dict
    return list(d)


def flatten_with_path(tree: Any, *, is_leaf: IsLeaf | None = None
                      ) -> tuple[list[tuple[KeyPath, Any]], TreeDef]:
  """``[(key path, leaf)]`` in order, and the structure; dict keys become str entries
  of the key path, sequence indices int ones (as Orbax names them)."""
  out: list[tuple[KeyPath, Any]] = []

  def walk(x: Any, path: KeyPath) -> TreeDef:
    if is_leaf is not None and is_leaf(x):
      out.append((path, x))
      return _LEAF
    if x is None:
      return _NONE
    if isinstance(x, dict):
      keys = _sorted_keys(x)
      return TreeDef("dict", tuple(walk(x[k], (*path, str(k))) for k in keys), tuple(keys))
    if isinstance(x, (list, tuple)):
      kind = "tuple" if isinstance(x, tuple) else "list"
      return TreeDef(kind, tuple(walk(v, (*path, i)) for i, v in enumerate(x)),
                     tuple_type=type(x) if kind == "tuple" and type(x) is not tuple else None)
    out.append((path, x))
    return _LEAF

  treedef = walk(tree, ())
  return out, treedef


def flatten(tree: Any, *, is_leaf: IsLeaf | None = None) -> tuple[list[Any], TreeDef]:
  """The leaves of ``tree`` in order, and its structure."""
  leaves, treedef = flatten_with_path(tree, is_leaf=is_leaf)
  return [leaf for _, leaf in leaves], treedef


def unflatten(treedef: TreeDef, leaves: list[Any]) -> Any:
  """The tree of ``treedef`` with ``leaves`` in order."""
  if len(leaves) != treedef.num_leaves:
    raise ValueError(f"{treedef.num_leaves} leaves expected, got {len(leaves)}")
  it = iter(leaves)

  def build(t: TreeDef) -> Any:
    if t.kind == "leaf":
      return next(it)
    if t.kind == "none":
      return None
    children = [build(c) for c in t.children]
    if t.kind == "dict":
      return dict(zip(t.keys, children))
    if t.kind == "list":
      return children
    return tuple(children) if t.tuple_type is None else tuple.__new__(t.tuple_type, children)

  return build(treedef)
