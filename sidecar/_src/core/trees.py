"""Pytrees for both processes: flatten, unflatten, key paths; no framework needed.

One library walks every tree the sidecar and the trainer share: a feed element the
sidecar batches, the structure a feed batch travels with, a state a checkpoint saves
or restores. It walks the standard containers itself, the way ``jax.tree_util`` does,
so leaves come in JAX's order whether JAX is there or not (a PyTorch trainer and its
sidecar have none):

- ``None``: a node with no children;
- ``dict`` and ``collections.defaultdict``: children in sorted key order (keys of
  types that do not sort: in the dict's order, where JAX refuses);
  ``collections.OrderedDict``: in its own order;
- ``list``, ``tuple`` and namedtuples (a namedtuple's key path entries are its field
  names, as JAX's ``GetAttrKey``);
- everything else is a leaf, except, when JAX is loaded (``"jax" in sys.modules``), a
  type registered with ``jax.tree_util`` (a Flax struct, a registered dataclass): JAX
  flattens it, one level at a time, as Grain's ``tree_lib`` takes JAX's path when it
  can. A subclass of dict, list or tuple that JAX does not know is walked as its base
  container (JAX would make it a leaf, which no array or codec takes).

A key path is what stock Orbax names a leaf: dict keys and attribute names as ``str``,
sequence indices as ``int`` (``jax/checkpoint.key_path`` makes the same of JAX's paths).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

KeyPath = tuple[str | int, ...]
IsLeaf = Callable[[Any], bool]

# The kinds of node of a TreeDef.
LEAF, NONE, DICT, ORDERED_DICT, DEFAULT_DICT, LIST, TUPLE, NAMEDTUPLE, REGISTERED = (
    "leaf", "none", "dict", "ordered_dict", "default_dict", "list", "tuple", "namedtuple",
    "registered")
# Leaves by their exact type, told apart before any other check: a feed flattens every
# element it batches.
_LEAF_TYPES = frozenset({np.ndarray, int, float, bool, complex, str, bytes})


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class TreeDef:
  """The structure of a flattened tree.

  Attributes:
    kind: one of LEAF, NONE, DICT, ORDERED_DICT, DEFAULT_DICT, LIST, TUPLE, NAMEDTUPLE,
      REGISTERED (a type registered with ``jax.tree_util``).
    children: the child nodes, in leaf order.
    keys: a dict's keys, in the order of ``children``.
    node: a namedtuple's class, a defaultdict's ``default_factory``, or a registered
      type's one-level ``jax.tree_util.PyTreeDef``; None otherwise.
    num_leaves: the leaves below this node.
  """
  kind: str
  children: tuple[TreeDef, ...] = ()
  keys: tuple[Any, ...] = ()
  node: Any = None
  num_leaves: int = 1

  def __repr__(self) -> str:
    if self.kind == LEAF:
      return "*"
    if self.kind == NONE:
      return "None"
    items = [repr(c) for c in self.children]
    if self.kind in (DICT, ORDERED_DICT, DEFAULT_DICT):
      body = "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(self.keys, items)) + "}"
      return body if self.kind == DICT else f"{self.kind}{body}"
    if self.kind == LIST:
      return "[" + ", ".join(items) + "]"
    if self.kind == TUPLE:
      return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if self.kind == NAMEDTUPLE:
      fields = self.node._fields
      return f"{self.node.__name__}(" + ", ".join(
          f"{f}={c}" for f, c in zip(fields, items)) + ")"
    return f"registered[{self.node}]({', '.join(items)})"


_LEAF = TreeDef(LEAF)
_NONE = TreeDef(NONE, num_leaves=0)


def _inner(kind: str, children: tuple[TreeDef, ...], keys: tuple[Any, ...] = (),
           node: Any = None) -> TreeDef:
  return TreeDef(kind, children, keys, node, sum(c.num_leaves for c in children))


def _sorted_keys(d: dict) -> list:
  try:
    return sorted(d)
  except TypeError:  # keys of types that do not sort (JAX refuses these): the dict's order
    return list(d)


def _namedtuple_fields(t: type) -> tuple[str, ...] | None:
  fields = getattr(t, "_fields", None)
  return fields if isinstance(fields, tuple) else None


def _registered(x: Any) -> tuple[list[tuple[Any, Any]], Any] | None:
  """``x``'s children as ``[(key, child)]`` and its one-level treedef, where JAX is
  loaded and knows ``type(x)`` as a node; else None."""
  jax: Any = sys.modules.get("jax")
  tree_util = getattr(jax, "tree_util", None)
  if tree_util is None or isinstance(x, jax.Array):
    return None
  kids, treedef = tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
  if len(kids) == 1 and kids[0][1] is x and not kids[0][0]:
    return None  # a leaf to JAX
  return [(key[0], child) for key, child in kids], treedef


def _jax_key(key: Any) -> str | int:
  """One entry of a JAX key path as Orbax names it (as ``jax/checkpoint.key_path``)."""
  name = type(key).__name__
  if name == "SequenceKey":
    return key.idx
  if name == "DictKey":
    return str(key.key)
  if name == "GetAttrKey":
    return key.name
  return str(getattr(key, "key", key))


class _Walk:
  """One flatten: the leaves (and their paths, where asked) in order."""

  __slots__ = ("leaves", "paths", "is_leaf")

  def __init__(self, with_paths: bool, is_leaf: IsLeaf | None):
    self.leaves: list[Any] = []
    self.paths: list[KeyPath] | None = [] if with_paths else None
    self.is_leaf = is_leaf

  def leaf(self, x: Any, path: KeyPath) -> TreeDef:
    self.leaves.append(x)
    if self.paths is not None:
      self.paths.append(path)
    return _LEAF

  def items(self, kind: str, pairs: list[tuple[Any, Any]], path: KeyPath,
            keys: tuple[Any, ...] = (), node: Any = None) -> TreeDef:
    """A node of children ``[(key path entry, child)]``."""
    paths = self.paths is not None
    return _inner(kind, tuple(self.walk(v, (*path, k) if paths else path) for k, v in pairs),
                  keys, node)

  def mapping(self, kind: str, x: Any, keys: list, path: KeyPath, node: Any = None) -> TreeDef:
    return self.items(kind, [(str(k), x[k]) for k in keys], path, tuple(keys), node)

  def walk(self, x: Any, path: KeyPath) -> TreeDef:
    if self.is_leaf is not None and self.is_leaf(x):
      return self.leaf(x, path)
    t = type(x)
    if t in _LEAF_TYPES:
      return self.leaf(x, path)
    if x is None:
      return _NONE
    if t is dict:
      return self.mapping(DICT, x, _sorted_keys(x), path)
    if t is list or t is tuple:
      return self.items(LIST if t is list else TUPLE, list(enumerate(x)), path)
    if isinstance(x, np.generic):
      return self.leaf(x, path)
    if isinstance(x, tuple) and (fields := _namedtuple_fields(t)) is not None:
      return self.items(NAMEDTUPLE, list(zip(fields, x)), path, node=t)
    if t is collections.OrderedDict:
      return self.mapping(ORDERED_DICT, x, list(x), path)
    if t is collections.defaultdict:
      return self.mapping(DEFAULT_DICT, x, _sorted_keys(x), path, x.default_factory)
    if (found := _registered(x)) is not None:
      kids, treedef = found
      return self.items(REGISTERED, [(_jax_key(k), v) for k, v in kids], path, node=treedef)
    if isinstance(x, dict):
      return self.mapping(DICT, x, _sorted_keys(x), path)
    if isinstance(x, (list, tuple)):
      return self.items(LIST if isinstance(x, list) else TUPLE, list(enumerate(x)), path)
    return self.leaf(x, path)


def flatten_with_path(tree: Any, *, is_leaf: IsLeaf | None = None
                      ) -> tuple[list[tuple[KeyPath, Any]], TreeDef]:
  """``[(key path, leaf)]`` in order, and the structure.

  Example::

    >>> flatten_with_path({"b": [1, None], "a": 2})[0]
    [(('a',), 2), (('b', 0), 1)]
  """
  w = _Walk(True, is_leaf)
  treedef = w.walk(tree, ())
  assert w.paths is not None
  return list(zip(w.paths, w.leaves)), treedef


def flatten(tree: Any, *, is_leaf: IsLeaf | None = None) -> tuple[list[Any], TreeDef]:
  """The leaves of ``tree`` in order, and its structure."""
  w = _Walk(False, is_leaf)
  treedef = w.walk(tree, ())
  return w.leaves, treedef


def leaves(tree: Any, *, is_leaf: IsLeaf | None = None) -> list[Any]:
  """The leaves of ``tree`` in order."""
  return flatten(tree, is_leaf=is_leaf)[0]


def unflatten(treedef: TreeDef, leaves: list[Any]) -> Any:
  """The tree of ``treedef`` with ``leaves`` in order, every container of its type.

  Raises:
    ValueError: ``leaves`` is not as many as the structure holds.
  """
  if len(leaves) != treedef.num_leaves:
    raise ValueError(f"{treedef.num_leaves} leaves expected, got {len(leaves)}")
  return _build(treedef, iter(leaves))


def _build(t: TreeDef, it: Iterator[Any]) -> Any:
  kind = t.kind
  if kind == LEAF:
    return next(it)
  if kind == NONE:
    return None
  children = [_build(c, it) for c in t.children]
  if kind == DICT:
    return dict(zip(t.keys, children))
  if kind == LIST:
    return children
  if kind == TUPLE:
    return tuple(children)
  if kind == NAMEDTUPLE:
    return t.node(*children)
  if kind == ORDERED_DICT:
    return collections.OrderedDict(zip(t.keys, children))
  if kind == DEFAULT_DICT:
    return collections.defaultdict(t.node, zip(t.keys, children))
  return sys.modules["jax"].tree_util.tree_unflatten(t.node, children)


def map_leaves(fn: Callable[[Any], Any], tree: Any, *, is_leaf: IsLeaf | None = None) -> Any:
  """``tree`` with each leaf replaced by ``fn(leaf)``."""
  flat, treedef = flatten(tree, is_leaf=is_leaf)
  return unflatten(treedef, [fn(x) for x in flat])


def map_with_path(fn: Callable[[KeyPath, Any], Any], tree: Any, *,
                  is_leaf: IsLeaf | None = None) -> Any:
  """``tree`` with each leaf replaced by ``fn(key path, leaf)``."""
  flat, treedef = flatten_with_path(tree, is_leaf=is_leaf)
  return unflatten(treedef, [fn(path, x) for path, x in flat])


def keystr(path: KeyPath) -> str:
  """A key path as error messages show it: ``['x'][0]``."""
  return "".join(f"[{k!r}]" for k in path)
