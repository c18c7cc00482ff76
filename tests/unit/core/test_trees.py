"""Tier 1: the one tree library walks trees as jax.tree_util does, with JAX loaded (its
path) or without it (its own walk)."""

import collections
import dataclasses
import random
import sys
from typing import NamedTuple

import jax
import numpy as np
import pytest

from sidecar._src.core import trees

pytestmark = pytest.mark.unit

Pair = collections.namedtuple("Pair", "a b")


class Typed(NamedTuple):
  x: object
  y: object


class SubPair(Pair):
  pass


def key_path(path):
  """A JAX key path as stock Orbax names a leaf (dict keys and attributes str, indices int)."""
  tu = jax.tree_util
  return tuple(k.idx if isinstance(k, tu.SequenceKey) else str(k.key) if isinstance(k, tu.DictKey)
               else k.name if isinstance(k, tu.GetAttrKey) else str(getattr(k, "key", k))
               for k in path)


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


STANDARD = {
    "leaf": np.arange(3),
    "none": None,
    "empty-containers": {"d": {}, "l": [], "t": ()},
    "sorted-dict-keys": {"z": 1, "a": 2, "m": {"y": 3, "b": 4}},
    "int-keys": {10: "x", 2: "y", -1: "z"},
    "nested": {"z": [np.int32(1), (2, Pair(3, [None, 4]))], "a": {"k": 5.0}},
    "namedtuples": [Typed(1, Typed(2, None)), SubPair(3, 4)],
    "ordered-dict": collections.OrderedDict([("b", 1), ("a", {"d": 2, "c": 3})]),
    "default-dict": collections.defaultdict(list, {"y": 1, "x": [2, 3]}),
    "scalars": [True, 1, 2.5, 3j, "s", b"b", np.float32(1), np.bool_(False)],
    "arrays": (jax.numpy.ones(2), np.zeros((2, 2))),
}
REGISTERED = {
    "registered": {"box": Box(np.zeros(2), {"q": 9, "p": None}), "e": Empty()},
    "registered-in-registered": Box(Box(1, 2), [Box(3, (4,)), None]),
}
TREE_UTIL = jax.tree_util  # JAX's own, to compare with, also where a test hides jax


@pytest.fixture(params=["jax-loaded", "no-jax"])
def walker(request, monkeypatch):
  """Where JAX is loaded trees.py takes its path; where it is not (a PyTorch process),
  it walks the trees itself."""
  if request.param == "no-jax":
    monkeypatch.delitem(sys.modules, "jax")
  return request.param


def _check_like_jax(tree):
  flat, treedef = trees.flatten_with_path(tree)
  want, want_def = TREE_UTIL.tree_flatten_with_path(tree)
  assert [id(x) for _, x in flat] == [id(x) for _, x in want]
  assert [p for p, _ in flat] == [key_path(p) for p, _ in want]
  assert treedef.num_leaves == want_def.num_leaves == len(flat)
  leaves, treedef2 = trees.flatten(tree)
  assert [id(x) for x in leaves] == [id(x) for _, x in want] and treedef2 == treedef
  back = trees.unflatten(treedef, [x for _, x in flat])
  assert TREE_UTIL.tree_structure(back) == want_def
  assert trees.flatten(back)[1] == treedef


@pytest.mark.parametrize("tree", list(STANDARD.values()), ids=list(STANDARD))
def test_leaves_paths_and_structure_are_jax_tree_utils(tree, walker):
  _check_like_jax(tree)


@pytest.mark.parametrize("tree", list(REGISTERED.values()), ids=list(REGISTERED))
def test_types_registered_with_jax_go_through_it(tree):
  _check_like_jax(tree)


def _random_tree(rng: random.Random, depth: int, kinds: list[str]):
  kind = rng.choice(kinds if depth < 4 else ["leaf", "none"])
  width = rng.randrange(4)
  child = lambda: _random_tree(rng, depth + 1, kinds)
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


def test_random_trees_flatten_in_jaxs_order_with_jaxs_paths(walker):
  rng = random.Random(36)
  kinds = ["leaf", "none", "dict", "list", "tuple", "named", "ordered"] + (
      ["box"] if walker == "jax-loaded" else [])
  for _ in range(300):
    _check_like_jax(_random_tree(rng, 0, kinds))


def test_unflatten_rebuilds_every_container_as_its_type(walker):
  tree = {"p": Pair(1, [None, 2]), "o": collections.OrderedDict(b=3, a=4),
          "d": collections.defaultdict(int, k=5), "t": (6,)}
  leaves, treedef = trees.flatten(tree)
  back = trees.unflatten(treedef, [v * 10 for v in leaves])
  assert back == {"p": Pair(10, [None, 20]), "o": {"b": 30, "a": 40}, "d": {"k": 50},
                  "t": (60,)}
  assert type(back["p"]) is Pair and type(back["t"]) is tuple
  assert type(back["o"]) is collections.OrderedDict and list(back["o"]) == ["b", "a"]
  assert type(back["d"]) is collections.defaultdict and back["d"].default_factory is int


def test_a_structure_is_equal_only_to_the_same_structure(walker):
  a = trees.flatten({"x": [1, 2], "y": None})[1]
  assert a == trees.flatten({"y": None, "x": [np.ones(3), "s"]})[1]
  assert hash(a) == hash(trees.flatten({"y": None, "x": [np.ones(3), "s"]})[1])
  assert a != trees.flatten({"x": [1, 2], "z": None})[1]
  assert a != trees.flatten({"x": (1, 2), "y": None})[1]
  assert a != trees.flatten({"x": [1, 2, 3], "y": None})[1]
  assert a != trees.flatten({"x": [1, Pair(2, 3)], "y": None})[1]


def test_a_structure_shows_its_containers(monkeypatch):
  monkeypatch.delitem(sys.modules, "jax")
  assert repr(trees.flatten({"b": Pair(1, None), "a": [2, (3,)]})[1]) == (
      "{'a': [*, (*,)], 'b': Pair(a=*, b=None)}")


def test_is_leaf_stops_the_walk(walker):
  flat, treedef = trees.flatten_with_path({"a": [1, 2], "b": (3,)},
                                          is_leaf=lambda x: isinstance(x, list))
  assert flat == [(("a",), [1, 2]), (("b", 0), 3)]
  assert trees.unflatten(treedef, ["L", 4]) == {"a": "L", "b": (4,)}


def test_keys_that_do_not_sort_keep_the_dicts_order(walker):
  # JAX refuses these ("Comparator raised exception"); the codec carries them. With JAX
  # loaded, a registered type below them still goes through JAX.
  box = Box(np.int8(1), None)
  tree = {"b": 1, 2: 2, "a": box}
  with pytest.raises(ValueError, match="Comparator"):
    TREE_UTIL.tree_flatten(tree)
  flat, treedef = trees.flatten_with_path(tree)
  if walker == "jax-loaded":
    assert flat == [(("b",), 1), (("2",), 2), (("a", "v"), box.v)]
    assert trees.unflatten(treedef, [4, 5, 6]) == {"b": 4, 2: 5, "a": Box(6, None)}
  else:
    assert flat == [(("b",), 1), (("2",), 2), (("a",), box)]
  assert trees.leaves(tree) == [x for _, x in flat]


def test_a_container_subclass_jax_does_not_know(walker):
  leaves, treedef = trees.flatten(Attrs(b=1, a=[2]))
  if walker == "no-jax":  # walked as its base container (controller/trees did so)
    assert leaves == [2, 1] and trees.unflatten(treedef, [3, 4]) == {"a": [3], "b": 4}
  else:  # a leaf, as JAX has it
    assert leaves == [Attrs(b=1, a=[2])]


def test_without_jax_loaded_a_registered_type_is_a_leaf(monkeypatch):
  # A PyTorch process has no JAX: nothing can be registered with it there.
  monkeypatch.delitem(sys.modules, "jax")
  box = Box(1, 2)
  flat, _ = trees.flatten_with_path({"b": box, "l": Pair(3, None)})
  assert flat == [(("b",), box), (("l", "a"), 3)]


def test_map_and_leaves(walker):
  tree = {"b": [1, 2], "a": Pair(3, None)}
  assert trees.leaves(tree) == [3, 1, 2]
  assert trees.map_leaves(lambda x: -x, tree) == {"b": [-1, -2], "a": Pair(-3, None)}
  assert trees.map_with_path(lambda p, x: trees.keystr(p), tree) == {
      "b": ["['b'][0]", "['b'][1]"], "a": Pair("['a']['a']", None)}


def test_unflatten_with_the_wrong_number_of_leaves_raises(walker):
  _, treedef = trees.flatten([1, (2, 3)])
  with pytest.raises(ValueError, match="3 leaves expected, got 2"):
    trees.unflatten(treedef, [1, 2])
