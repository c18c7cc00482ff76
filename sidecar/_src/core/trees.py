"""Pytrees for both processes: flatten, unflatten, key paths; no framework needed.

One library walks every tree the sidecar and the trainer share: a feed element the
sidecar batches, the structure a feed batch travels with, a state a checkpoint saves
or restores. As Grain's ``tree_lib``, it takes JAX's path where JAX is loaded
(``"jax" in sys.modules``: ``jax.tree_util``, its C++ walk and every type registered
with it) and walks the trees itself where it is not (a PyTorch trainer and its sidecar
have no JAX), in JAX's leaf order:

- ``None``: a node with no children;
- ``dict`` and ``collections.defaultdict``: children in sorted key order;
  ``collections.OrderedDict``: in its own order;
- ``list``, ``tuple`` and namedtuples (a namedtuple's key path entries are its field
  names, as JAX's ``GetAttrKey``);
- everything else is a leaf.

Where they differ: keys of types that do not sort (JAX refuses them) are walked here, in
the dict's order, with JAX loaded too; without JAX a subclass of dict, list or tuple is
walked as its base container (JAX makes it a leaf).

A key path is what stock Orbax names a leaf: dict keys and attribute names as ``str``,
sequence indices as ``int``.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

KeyPath = tuple[str | int, ...]
IsLeaf = Callable[[Any], bool]

# A structure is JAX's PyTreeDef where JAX flattened the tree, else a nested tuple (C code
# compares and hashes it, a feed compares one per element): a leaf is _LEAF, None is
# None, any other node (kind, aux, children) with ``aux`` a dict's keys, a namedtuple's
# class, a defaultdict's (default_factory, keys) or a registered type's one-level
# jax.tree_util.PyTreeDef.
_LEAF = "*"
DICT, ORDERED_DICT, DEFAULT_DICT, LIST, TUPLE, NAMEDTUPLE, REGISTERED = (
    "dict", "ordered_dict", "default_dict", "list", "tuple", "namedtuple", "registered")
# Leaves by their exact type, told apart before any other check.
_LEAF_TYPES = frozenset({np.ndarray, int, float, bool, complex, str, bytes})


class TreeDef:
  """The structure of a flattened tree: equal to another of the same containers, keys
  and types (hashable); ``num_leaves`` leaves."""

  __slots__ = ("_node", "num_leaves")

  def __init__(self, node: Any, num_leaves: int):
    self._node, self.num_leaves = node, num_leaves

  def __eq__(self, other: object) -> bool:
    return isinstance(other, TreeDef) and self._node == other._node

  def __hash__(self) -> int:
    return hash(self._node)

  def __repr__(self) -> str:
    return _repr(self._node)


def _repr(node: Any) -> str:
  if node is _LEAF:
    return "*"
  if node is None:
    return "None"
  if not isinstance(node, tuple):
    return str(node)  # JAX's PyTreeDef
  kind, aux, children = node
  items = [_repr(c) for c in children]
  if kind in (DICT, ORDERED_DICT, DEFAULT_DICT):
    keys = aux[1] if kind == DEFAULT_DICT else aux
    body = "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(keys, items)) + "}"
    return body if kind == DICT else f"{kind}{body}"
  if kind == LIST:
    return "[" + ", ".join(items) + "]"
  if kind == TUPLE:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
  if kind == NAMEDTUPLE:
    return f"{aux.__name__}(" + ", ".join(f"{f}={c}" for f, c in zip(aux._fields, items)) + ")"
  return f"registered[{aux}]({', '.join(items)})"


def _sorted_keys(d: dict) -> tuple:
  try:
    return tuple(sorted(d))
  except TypeError:  # keys of types that do not sort (JAX refuses these): the dict's order
    return tuple(d)


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
  """One entry of a JAX key path as Orbax names it."""
  name = type(key).__name__
  if name == "SequenceKey":
    return key.idx
  if name == "DictKey":
    return str(key.key)
  if name == "GetAttrKey":
    return key.name
  return str(getattr(key, "key", key))


def _split(x: Any, t: type) -> tuple[str, Any, list, list] | None:
  """A node other than dict, list, tuple and None: ``(kind, aux, key path entries,
  children)``; None for a leaf."""
  if isinstance(x, np.generic):
    return None
  if isinstance(x, tuple) and isinstance(fields := getattr(t, "_fields", None), tuple):
    return NAMEDTUPLE, t, list(fields), list(x)
  if t is collections.OrderedDict:
    keys = tuple(x)
    return ORDERED_DICT, keys, [str(k) for k in keys], [x[k] for k in keys]
  if t is collections.defaultdict:
    keys = _sorted_keys(x)
    return DEFAULT_DICT, (x.default_factory, keys), [str(k) for k in keys], [x[k] for k in keys]
  if (found := _registered(x)) is not None:
    kids, treedef = found
    return REGISTERED, treedef, [_jax_key(k) for k, _ in kids], [v for _, v in kids]
  if isinstance(x, dict):  # a subclass JAX does not know: as a dict
    keys = _sorted_keys(x)
    return DICT, keys, [str(k) for k in keys], [x[k] for k in keys]
  if isinstance(x, (list, tuple)):
    return (LIST if isinstance(x, list) else TUPLE), None, list(range(len(x))), list(x)
  return None


def _flat(x: Any, leaves: list, is_leaf: IsLeaf | None) -> Any:
  """The structure of ``x``; its leaves appended to ``leaves``."""
  if is_leaf is not None and is_leaf(x):
    leaves.append(x)
    return _LEAF
  t = type(x)
  if t in _LEAF_TYPES:
    leaves.append(x)
    return _LEAF
  if x is None:
    return None
  if t is dict:
    keys = _sorted_keys(x)
    return DICT, keys, tuple([_flat(x[k], leaves, is_leaf) for k in keys])
  if t is list:
    return LIST, None, tuple([_flat(v, leaves, is_leaf) for v in x])
  if t is tuple:
    return TUPLE, None, tuple([_flat(v, leaves, is_leaf) for v in x])
  node = _split(x, t)
  if node is None:
    leaves.append(x)
    return _LEAF
  kind, aux, _, children = node
  return kind, aux, tuple([_flat(v, leaves, is_leaf) for v in children])


def _flat_path(x: Any, path: KeyPath, leaves: list, paths: list, is_leaf: IsLeaf | None
               ) -> Any:
  """As ``_flat``, with each leaf's key path appended to ``paths``."""
  if is_leaf is not None and is_leaf(x):
    leaves.append(x)
    paths.append(path)
    return _LEAF
  t = type(x)
  if x is None:
    return None
  if t is dict:
    keys = _sorted_keys(x)
    node: tuple | None = DICT, keys, [str(k) for k in keys], [x[k] for k in keys]
  elif t is list or t is tuple:
    node = LIST if t is list else TUPLE, None, list(range(len(x))), x
  else:
    node = None if t in _LEAF_TYPES else _split(x, t)
  if node is None:
    leaves.append(x)
    paths.append(path)
    return _LEAF
  kind, aux, entries, children = node
  return kind, aux, tuple([_flat_path(v, (*path, k), leaves, paths, is_leaf)
                           for k, v in zip(entries, children)])


def _tree_util() -> Any:
  """``jax.tree_util`` where JAX is loaded, else None."""
  return getattr(sys.modules.get("jax"), "tree_util", None)


def flatten_with_path(tree: Any, *, is_leaf: IsLeaf | None = None
                      ) -> tuple[list[tuple[KeyPath, Any]], TreeDef]:
  """``[(key path, leaf)]`` in order, and the structure.

  Example::

    >>> flatten_with_path({"b": [1, None], "a": 2})[0]
    [(('a',), 2), (('b', 0), 1)]
  """
  if (tree_util := _tree_util()) is not None:
    try:
      flat, treedef = tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    except ValueError:  # dict keys that do not sort: walked here, in the dict's order
      pass
    else:
      return ([(tuple([_jax_key(k) for k in path]), leaf) for path, leaf in flat],
              TreeDef(treedef, len(flat)))
  leaves: list = []
  paths: list = []
  node = _flat_path(tree, (), leaves, paths, is_leaf)
  return list(zip(paths, leaves)), TreeDef(node, len(leaves))


def flatten(tree: Any, *, is_leaf: IsLeaf | None = None) -> tuple[list[Any], TreeDef]:
  """The leaves of ``tree`` in order, and its structure."""
  if (tree_util := _tree_util()) is not None:
    try:
      flat, treedef = tree_util.tree_flatten(tree, is_leaf=is_leaf)
    except ValueError:  # dict keys that do not sort: walked here, in the dict's order
      pass
    else:
      return flat, TreeDef(treedef, len(flat))
  leaves: list = []
  node = _flat(tree, leaves, is_leaf)
  return leaves, TreeDef(node, len(leaves))


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
  node = treedef._node
  if node is None or node is _LEAF or type(node) is tuple:
    return _build(node, iter(leaves))
  return sys.modules["jax"].tree_util.tree_unflatten(node, leaves)  # JAX's own


def _build(node: Any, it: Any) -> Any:
  if node is _LEAF:
    return next(it)
  if node is None:
    return None
  kind, aux, children = node
  if kind is DICT:
    return {k: _build(c, it) for k, c in zip(aux, children)}
  if kind is LIST:
    return [_build(c, it) for c in children]
  if kind is TUPLE:
    return tuple([_build(c, it) for c in children])
  if kind is NAMEDTUPLE:
    return aux(*[_build(c, it) for c in children])
  if kind is ORDERED_DICT:
    return collections.OrderedDict([(k, _build(c, it)) for k, c in zip(aux, children)])
  if kind is DEFAULT_DICT:
    factory, keys = aux
    return collections.defaultdict(factory, [(k, _build(c, it)) for k, c in zip(keys, children)])
  return sys.modules["jax"].tree_util.tree_unflatten(aux, [_build(c, it) for c in children])


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
