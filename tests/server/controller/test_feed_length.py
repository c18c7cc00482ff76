"""``Controller.feed_length``: a feed's global batches from its start, as a sidecar
answers without reading a row; None where the pipeline has no length or reads forever."""

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.core import errors
from sidecar._src.user import registry as registry_lib

pytestmark = pytest.mark.server

READ = []  # the rows the map pipelines read, in this process (the sidecar runs in it)


def rows(ctx, n: int = 10):
  return grain.MapDataset.range(n).map(lambda i: READ.append(i) or {"x": np.int64(i)})


def endless(ctx):
  while True:
    yield {"x": np.int64(0)}


@pytest.fixture(params=[True, False], ids=["worker-socket", "grpc"])
def ctl(make_server, request):
  reg = registry_lib.Registry()
  reg.add("pipeline", "rows", rows)
  reg.add("pipeline", "endless", endless)
  server = make_server(registry=reg, device_ids=(0,))
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], attach=request.param) as c:
    assert (c.worker(0) is not None) is request.param
    yield c


def test_a_map_pipelines_length_is_its_full_batches_times_its_epochs(ctl):
  READ.clear()
  assert ctl.feed_length("rows", global_batch_size=4, num_epochs=3) == 6  # 10 // 4 = 2 a pass
  assert ctl.feed_length("rows", global_batch_size=5, kwargs={"n": 20}, num_epochs=1) == 4
  assert READ == []  # no row was read for it
  # and exactly as many as the feed yields
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with ctl.feed("rows", global_batch_size=4, num_epochs=3, sharding=sharding) as feed:
    assert sum(1 for _ in feed) == 6


def test_no_length_for_an_iterable_or_an_endless_feed(ctl):
  assert ctl.feed_length("endless", global_batch_size=4, num_epochs=1) is None
  assert ctl.feed_length("rows", global_batch_size=4) is None  # num_epochs None: forever


def test_a_bad_length_question_gets_the_feeds_own_errors(ctl):
  with pytest.raises(errors.InvalidArgumentError, match="global_batch_size 40 exceeds the 10"):
    ctl.feed_length("rows", global_batch_size=40, num_epochs=1)
  with pytest.raises(errors.NotRegisteredError):
    ctl.feed_length("nope", global_batch_size=4, num_epochs=1)
