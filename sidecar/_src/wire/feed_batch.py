"""One host's part of a feed's global batch <-> ``pb.FeedBatch``.

A batch's arrays are per leaf of the pipeline's element and per row range of the
host's rows. The element's structure travels apart from them, as the element's tree
with each leaf its index into ``leaves``: the pipeline's own containers (lists,
tuples, namedtuples, dicts) are never mistaken for ours, and ours never for theirs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from sidecar._src.core import errors, trees
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb


@dataclasses.dataclass(frozen=True, slots=True)
class HostBatch:
  """A decoded ``pb.FeedBatch``.

  Attributes:
    structure: the element's tree, each leaf an int: its index in ``leaves``.
    leaves: per leaf of the element, one array per row range of the host (in order).
    state: the host's feed state after this batch.
    produce_s: the host's time making it.
  """
  structure: Any
  leaves: tuple[tuple[np.ndarray, ...], ...]
  state: dict[str, Any]
  produce_s: float


def structure(tree: Any, *, where: str) -> pb.Value:
  """The encoded structure of an element: ``tree`` with each leaf its index (an int).

  Raises:
    InvalidArgumentError: a container the codec cannot carry, naming its path.
  """
  return codec.encode(tree, where=where)


def encode(structure_value: pb.Value, leaves: Sequence[Sequence[np.ndarray]],
           state: dict[str, Any], produce_s: float, *, to_arena: codec.ToArena | None,
           where: str) -> pb.FeedBatch:
  """A batch's message; each array a descriptor where ``to_arena`` gives one."""
  return pb.FeedBatch(
      structure=structure_value, state_json=json.dumps(state), produce_s=produce_s,
      leaves=[pb.FeedLeaf(parts=[_encoded_array(a, to_arena, where, i) for a in parts])
              for i, parts in enumerate(leaves)])


def _encoded_array(a: np.ndarray, to_arena: codec.ToArena | None, where: str, i: int) -> pb.Value:
  """One array of a batch: its descriptor where ``to_arena`` placed it (a block the feed
  made for it, C-contiguous in a dtype the batch's layout checked: nothing to check per
  batch), else encoded as any value is (checked, and inline where ``to_arena`` is None)."""
  if to_arena is not None and a.nbytes and a.flags.c_contiguous:
    ref = to_arena(a)
    if ref is not None:
      return codec.arena_value(ref)
  return codec.encode(a, to_arena=to_arena, inline_limit=0, where=f"{where} leaf {i}")


def decode(batch: pb.FeedBatch, *, from_arena: codec.FromArena | None, where: str
           ) -> HostBatch:
  """A batch, checked: every leaf index of the structure names one leaf."""
  tree = codec.decode(batch.structure, where=f"{where} structure")
  leaves = tuple(
      tuple(_array(codec.decode(p, from_arena=from_arena, where=f"{where} leaf {i}"), where)
            for p in leaf.parts) for i, leaf in enumerate(batch.leaves))
  try:
    state = json.loads(batch.state_json)
  except json.JSONDecodeError as e:
    raise errors.InvalidArgumentError(f"{where}: bad state_json: {e}") from None
  out = HostBatch(tree, leaves, state, batch.produce_s)
  indices = sorted(_indices(tree, where))
  if indices != list(range(len(leaves))):
    raise errors.InvalidArgumentError(
        f"{where}: the structure names leaves {indices[:10]}, but {len(leaves)} came")
  return out


def item_blocks(item: pb.StreamItem) -> list[int]:
  """The arena blocks a stream item refers to (its value's, or its feed batch's), as
  flattened (offset, generation) pairs."""
  if not item.HasField("batch"):
    return codec.arena_blocks(item.value)
  return [x for leaf in item.batch.leaves for p in leaf.parts for x in codec.arena_blocks(p)]


def _array(x: Any, where: str) -> np.ndarray:
  if not isinstance(x, np.ndarray):
    raise errors.InvalidArgumentError(f"{where}: a leaf part is {type(x).__name__}, not an array")
  return x


def _indices(tree: Any, where: str) -> list[int]:
  out = trees.leaves(tree)
  for x in out:
    if not isinstance(x, int) or isinstance(x, bool):
      raise errors.InvalidArgumentError(
          f"{where}: the structure holds {x!r:.40}, not a leaf's index")
  return out


def fill(tree: Any, leaves: Sequence[Any]) -> Any:
  """``tree`` (a structure) with each index replaced by its entry of ``leaves``, every
  container of the same type (a namedtuple as its class)."""
  indices, treedef = trees.flatten(tree)
  return trees.unflatten(treedef, [leaves[i] for i in indices])
