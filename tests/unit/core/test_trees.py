"""Tier 1: the one tree library walks trees as jax.tree_util does, with JAX or without it."""

import collections
import dataclasses
import random
import sys
from typing import NamedTuple

import jax
import numpy as np
import pytest

from sidecar._src.core import trees
from sidecar._src.jax.checkpoint import key_path

pytestmark = pytest.mark.unit

Pair = collections.namedtuple("Pair", "a b")


class Typed(NamedTuple):
  x: object
  y: object


class SubPair(Pair):
  pass


@dataclasses.dataclass
class Box:
  v: object
  w: object


jax.tree_util.register_dataclass(Box, data_fields=["v", "w"], meta_fields=[])


@dataclasses.dataclass
class Empty:
  pass


jax.tree_util.register_dataclass(Empty, data_fields=[], meta_fields=[])


class Attrs(dict):
  """A dict subclass JAX does not know (a leaf to JAX)."""


TREES = {
    "leaf": np.arange(3),
    "none": None,
    "empty-containers": {"d": {}, "l": [], "t": ()},
    "sorted-dict-keys": {"z": 1, "a": 2, "m": {"y": 3, "b": 4}},
    "int-keys": {10: "x", 2: "y", -1: "z"},
    "nested": {"z": [np.int32(1), (2, Pair(3, [None, 4]))], "a": {"k": 5.0}},
    "namedtuples": [Typed(1, Typed(2, None)), SubPair(3, 4)],
    "ordered-dict": collections.OrderedDict([("b", 1), ("a", {"d": 2, "c": 3})]),
    "default-dict": collections.defaultdict(list, {"y": 1, "x": [2, 3]}),
    "registered": {"box": Box(np.zeros(2), {"q": 9, "p": None}), "e": Empty()},
    "registered-in-registered": Box(Box(1, 2), [Box(3, (4,)), None]),
    "scalars": [True, 1, 2.5, 3j, "s", b"b", np.float32(1), np.bool_(False)],
    "arrays": (jax.numpy.ones(2), np.zeros((2, 2))),
}


@pytest.mark.parametrize("tree", list(TREES.values()), ids=list(TREES))
def test_leaves_paths_and_structure_are_jax_tree_utils(tree):
  flat, treedef = trees.flatten_with_path(tree)
  want, want_def = jax.tree_util.tree_flatten_with_path(tree)
  assert [x for _, x in flat] == [x for _, x in want] or all(
      a is b for (_, a), (_, b) in zip(flat, want))
  assert [p for p, _ in flat] == [key_path(p) for p, _ in want]
  assert treedef.num_leaves == want_def.num_leaves == len(flat)
  back = trees.unflatten(treedef, [x for _, x in flat])
  assert jax.tree_util.tree_structure(back) == want_def
  assert trees.flatten(back)[1] == treedef


def _random_tree(rng: random.Random, depth: int):
  kind = rng.choice(["leaf", "none", "dict", "list", "tuple", "named", "ordered", "box"]
                    if depth < 4 else ["leaf", "none"])
  width = rng.randrange(4)
  child = lambda: _random_tree(rng, depth + 1)
  if kind == "leaf":
    return rng.choice([rng.randrange(100), np.float32(rng.random()), np.arange(rng.randrange(3))])
  if kind == "none":
    return None
  if kind in ("dict", "ordered"):
    keys = rng.sample(["a", "b", "c", "dd", "e1", "e10", "Z"], width)
    made = {k: child() for k in keys}
    return made if kind == "dict" else collections.OrderedDict(made)
  if kind in ("list", "tuple"):
    items = [child() for _ in range(width)]
    return items if kind == "list" else tuple(items)
  if kind == "named":
    return Typed(child(), child())
  return Box(child(), child())


def test_random_trees_flatten_in_jaxs_order_with_jaxs_paths():
  rng = random.Random(36)
  for _ in range(300):
    tree = _random_tree(rng, 0)
    flat, treedef = trees.flatten_with_path(tree)
    want, want_def = jax.tree_util.tree_flatten_with_path(tree)
    assert [id(x) for _, x in flat] == [id(x) for _, x in want], tree
    assert [p for p, _ in flat] == [key_path(p) for p, _ in want], tree
    assert jax.tree_util.tree_structure(trees.unflatten(treedef, [0] * len(flat))) == (
        jax.tree_util.tree_structure(jax.tree_util.tree_unflatten(want_def, [0] * len(flat))))


def test_unflatten_rebuilds_every_container_as_its_type():
  tree = {"p": Pair(1, [None, 2]), "o": collections.OrderedDict(b=3, a=4),
          "d": collections.defaultdict(int, k=5), "t": (6,), "x": Box(7, 8)}
  leaves, treedef = trees.flatten(tree)
  back = trees.unflatten(treedef, [v * 10 for v in leaves])
  assert back == {"p": Pair(10, [None, 20]), "o": {"b": 30, "a": 40}, "d": {"k": 50},
                  "t": (60,), "x": Box(70, 80)}
  assert type(back["p"]) is Pair and type(back["t"]) is tuple
  assert type(back["o"]) is collections.OrderedDict and list(back["o"]) == ["b", "a"]
  assert type(back["d"]) is collections.defaultdict and back["d"].default_factory is int
  assert type(back["x"]) is Box


def test_a_structure_is_equal_only_to_the_same_structure():
  a = trees.flatten({"x": [1, 2], "y": None})[1]
  assert a == trees.flatten({"y": None, "x": [np.ones(3), "s"]})[1]
  assert a != trees.flatten({"x": [1, 2], "z": None})[1]
  assert a != trees.flatten({"x": (1, 2), "y": None})[1]
  assert a != trees.flatten({"x": [1, 2, 3], "y": None})[1]
  assert repr(trees.flatten({"b": Pair(1, None), "a": [2, (3,)]})[1]) == (
      "{'a': [*, (*,)], 'b': Pair(a=*, b=None)}")


def test_is_leaf_stops_the_walk():
  flat, treedef = trees.flatten_with_path({"a": [1, 2], "b": (3,)},
                                          is_leaf=lambda x: isinstance(x, list))
  assert flat == [(("a",), [1, 2]), (("b", 0), 3)]
  assert trees.unflatten(treedef, ["L", 4]) == {"a": "L", "b": (4,)}


def test_keys_that_do_not_sort_keep_the_dicts_order():
  # JAX refuses these ("Comparator raised exception"); the codec carries them.
  flat, treedef = trees.flatten_with_path({"b": 1, 2: 2, "a": 3})
  assert flat == [(("b",), 1), (("2",), 2), (("a",), 3)]
  assert trees.unflatten(treedef, [4, 5, 6]) == {"b": 4, 2: 5, "a": 6}


def test_a_container_subclass_jax_does_not_know_is_walked_as_its_base():
  leaves, treedef = trees.flatten(Attrs(b=1, a=[2]))
  assert leaves == [2, 1] and trees.unflatten(treedef, [3, 4]) == {"a": [3], "b": 4}
  assert jax.tree_util.tree_leaves(Attrs(b=1)) == [Attrs(b=1)]  # a leaf to JAX


def test_without_jax_loaded_a_registered_type_is_a_leaf(monkeypatch):
  # A PyTorch process has no JAX: nothing can be registered with it there.
  monkeypatch.delitem(sys.modules, "jax")
  box = Box(1, 2)
  flat, _ = trees.flatten_with_path({"b": box, "l": Pair(3, None)})
  assert flat == [(("b",), box), (("l", "a"), 3)]


def test_map_and_leaves():
  tree = {"b": [1, 2], "a": Pair(3, None)}
  assert trees.leaves(tree) == [3, 1, 2]
  assert trees.map_leaves(lambda x: -x, tree) == {"b": [-1, -2], "a": Pair(-3, None)}
  assert trees.map_with_path(lambda p, x: trees.keystr(p), tree) == {
      "b": ["['b'][0]", "['b'][1]"], "a": Pair("['a']['a']", None)}


def test_unflatten_with_the_wrong_number_of_leaves_raises():
  _, treedef = trees.flatten([1, (2, 3)])
  with pytest.raises(ValueError, match="3 leaves expected, got 2"):
    trees.unflatten(treedef, [1, 2])
