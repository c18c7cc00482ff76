"""Tier 2: every pytree Grain accepts (dicts, lists, tuples, namedtuples, nested) comes
back as it was through ``ctl.feed``, ``ctl.stream`` and ``ctl.call``; a structure the
codec cannot carry is InvalidArgumentError naming its path in the tree."""

import dataclasses
import gc
from typing import NamedTuple

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.user import registry as registry_lib
from tests.conftest import eventually

pytestmark = pytest.mark.server


class Views(NamedTuple):
  crop: np.ndarray
  extra: list


def element(i):
  """Crops in a list, a tuple with a namedtuple in it, a None, a scalar: as Grain takes them."""
  i = int(i)
  return {"x": [np.full((4,), i, np.float32), np.full((2,), -i, np.float32)], "y": np.int32(i),
          "t": (np.int64(i), Views(np.full((3,), i, np.int16), [None, np.float32(i)]))}


def listed(ctx: sidecar.PipelineContext, n: int = 16):
  return grain.MapDataset.range(n).map(element)


def listed_iter(ctx: sidecar.PipelineContext, n: int = 16):
  for i in range(ctx.shard_index, n, ctx.shard_count)[ctx.position:]:
    yield element(i)


@dataclasses.dataclass
class Box:
  v: np.ndarray


jax.tree_util.register_dataclass(Box, data_fields=["v"], meta_fields=[])


def boxed(ctx: sidecar.PipelineContext):
  return grain.MapDataset.range(8).map(lambda i: {"x": [np.int32(i), Box(np.zeros(2))]})


def items(n: int):
  return (element(i) for i in range(n))


@pytest.fixture(params=[True, False], ids=["arena", "inline"])
def ctl(make_server, request):
  reg = registry_lib.Registry()
  for kind, fn in [("pipeline", listed), ("pipeline", listed_iter), ("pipeline", boxed),
                   ("function", items)]:
    reg.add(kind, fn.__name__, fn)
  reg.add("function", "echo", lambda x: x)
  server = make_server(registry=reg, device_ids=(0,))
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], attach=request.param) as c:
    yield c


def _sharding():
  return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


def assert_batch_of(batch, ids):
  assert isinstance(batch["x"], list) and len(batch["x"]) == 2
  np.testing.assert_array_equal(np.asarray(batch["x"][0]), np.repeat([ids], 4, 0).T)
  np.testing.assert_array_equal(np.asarray(batch["x"][1]), -np.repeat([ids], 2, 0).T)
  np.testing.assert_array_equal(np.asarray(batch["y"]), ids)
  t = batch["t"]
  assert type(t) is tuple and type(t[1]) is Views and t[1].extra[0] is None
  np.testing.assert_array_equal(np.asarray(t[0]), ids)
  assert t[1].crop.shape == (len(ids), 3) and t[1].crop.dtype == np.int16
  np.testing.assert_array_equal(np.asarray(t[1].extra[1]), ids)


@pytest.mark.parametrize("name", ["listed", "listed_iter"], ids=["map", "iterable"])
def test_a_feed_of_elements_with_lists_tuples_and_namedtuples(ctl, name):
  with ctl.feed(name, global_batch_size=4, sharding=_sharding(), num_epochs=1,
                options=sidecar.FeedOptions(prefetch=1)) as feed:
    batches = list(feed)
  assert len(batches) == 4
  seen = []
  for b in batches:
    ids = np.asarray(b["y"]).tolist()
    assert_batch_of(b, ids)
    seen += ids
  assert sorted(seen) == list(range(16))


def test_a_stream_and_a_call_give_back_the_tree_they_carry(ctl):
  with ctl.stream("items", kwargs={"n": 3}) as s:
    got = list(s)
  assert len(got) == 3
  for i, item in enumerate(got):
    assert_batch_of(jax.tree.map(lambda a: np.asarray(a)[None], item), [i])
  (back,) = ctl.call("echo", args=(element(5),))
  assert_batch_of(jax.tree.map(lambda a: np.asarray(a)[None], back), [5])


def test_a_structure_the_codec_cannot_carry_names_its_path(ctl):
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"pipeline 'boxed': element\['x'\]\[1\]: values of type .*Box"):
    with ctl.feed("boxed", global_batch_size=4, sharding=_sharding()) as feed:
      next(feed)
  with pytest.raises(sidecar.InvalidArgumentError, match=r"args\[0\]\['b'\]\[1\]: .*Box"):
    ctl.call("echo", args=({"b": [1, Box(np.zeros(2))]},))


def test_the_blocks_of_batches_sent_ahead_and_never_taken_go_back(ctl):
  with ctl.feed("listed", global_batch_size=4, sharding=_sharding(),
                options=sidecar.FeedOptions(prefetch=3)) as feed:
    batch = next(feed)
    if ctl.worker(0) is not None:  # inline, each batch's blocks went back once it was sent
      assert eventually(lambda: ctl.status()[0].arena_used > 0)  # the batches sent ahead
  del batch
  gc.collect()
  # (of the arena, only the batches the sidecar keeps for re-done steps stay)
  assert eventually(lambda: ctl.status()[0].arena_used == ctl.status()[0].arena_kept)
