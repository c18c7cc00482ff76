"""Tier 1: the controller core's pytrees walk the codec's containers as jax.tree_util does."""

import collections

import jax
import numpy as np
import pytest

from sidecar._src.controller import trees

pytestmark = pytest.mark.unit

Pair = collections.namedtuple("Pair", "a b")


def test_flatten_and_unflatten_keep_every_container_and_the_leaf_order_of_jax():
  tree = {"z": [np.int32(1), (2, Pair(3, [None, 4]))], "a": {"k": 5.0}}
  leaves, treedef = trees.flatten(tree)
  assert leaves == jax.tree_util.tree_leaves(tree) == [5.0, 1, 2, 3, 4]
  back = trees.unflatten(treedef, [x * 10 for x in leaves])
  assert back == {"z": [10, (20, Pair(30, [None, 40]))], "a": {"k": 50.0}}
  pair = back["z"][1][1]
  assert type(pair) is Pair and type(back["z"][1]) is tuple and type(back["z"]) is list
  assert [p for p, _ in trees.flatten_with_path(tree)[0]] == [
      ("a", "k"), ("z", 0), ("z", 1, 0), ("z", 1, 1, 0), ("z", 1, 1, 1, 1)]
