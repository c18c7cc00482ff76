"""``controller.feed.Feed`` with no process: the sidecars' streams are in-process fakes.

Feed talks to the sidecars through one seam, ``open_stream(host, FeedSpec)``, which
returns an iterator of items (``feed_batch.HostBatch``: the element's structure, per
leaf one array per row range of the host's plan, the position after that batch and
the time it took). The fake below
yields the integers of row ``r`` of global batch ``k`` (``k * batch + r``), from the
position the FeedSpec's state names, as a sidecar does with a ``grain.MapDataset``.
"""

import json
import os
import signal
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.controller import arguments, feed as feed_lib
from sidecar._src.jax import feed as jax_feed
from sidecar._src.wire import feed_batch

pytestmark = pytest.mark.unit

BATCH = 8


class FakeStream:
  """One host's stream: batches from ``spec``'s start position; ``fail_at`` raises there."""

  def __init__(self, spec, *, batches: int = 100, fail_at: int | None = None,
               interrupt_at: int | None = None, sigint_at: int | None = None, structure=None):
    start = json.loads(spec.state_json)
    self.position = start.get("position", 0)
    self.ranges = [(r.start, r.stop) for r in spec.rows]
    self.batches, self.fail_at, self.interrupt_at = batches, fail_at, interrupt_at
    self.sigint_at = sigint_at  # a real Ctrl-C, after this part was read
    self.structure = {"x": 0} if structure is None else structure
    self.closed = False

  def __next__(self):
    if self.closed or self.position >= self.batches:
      raise StopIteration
    if self.position == self.fail_at:
      raise sidecar.HostLostError("the fake sidecar died")
    if self.position == self.interrupt_at:
      self.interrupt_at = None
      raise KeyboardInterrupt
    if self.position == self.sigint_at:
      os.kill(os.getpid(), signal.SIGINT)
    k = self.position
    self.position += 1
    n = len(jax.tree_util.tree_leaves(self.structure))  # its leaves are the indices
    leaves = tuple(tuple(np.arange(k * BATCH + a, k * BATCH + b) * (i + 1)
                         for a, b in self.ranges) for i in range(n))
    return feed_batch.HostBatch(self.structure, leaves,
                                {"kind": "map", "epoch": 0, "position": self.position}, 0.0)

  def close(self):
    self.closed = True


def make_feed(state=None, seed=0, fake=None):
  devices = jax.devices()[:4]  # hosts 0 and 1, two devices each
  sharding = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))
  layout = jax_feed.Layout(sharding, BATCH, {d.id: i // 2 for i, d in enumerate(devices)})
  streams = {}

  def open_stream(host, spec):
    streams[host] = FakeStream(spec, **(fake or {}).get(host, {}))
    return streams[host]

  feed = feed_lib.Feed(name="ids", layout=layout, seed=seed, num_epochs=None, prefetch=2,
                       state=state, workers=0, open_stream=open_stream)
  return feed, streams


def test_hosts_parts_become_global_batches_in_row_order():
  feed, streams = make_feed()
  with feed:
    for k in range(3):
      batch = next(feed)
      assert batch["x"].shape == (BATCH,)
      np.testing.assert_array_equal(np.asarray(batch["x"]), np.arange(k * BATCH, (k + 1) * BATCH))
    assert feed.state()["position"] == 3 and feed.stats()["batches"] == 3
  assert all(s.closed for s in streams.values())


class Pair(NamedTuple):
  a: Any
  b: Any


def test_the_pipelines_lists_tuples_and_namedtuples_are_the_batchs():
  structure = {"x": [0, 1], "t": (2, Pair(3, [None, 4]))}
  feed, _ = make_feed(fake={0: {"structure": structure}, 1: {"structure": structure}})
  with feed:
    batch = next(feed)
  assert isinstance(batch["x"], list) and len(batch["x"]) == 2
  assert type(batch["t"]) is tuple and type(batch["t"][1]) is Pair and batch["t"][1].b[0] is None
  np.testing.assert_array_equal(np.asarray(batch["x"][1]), 2 * np.arange(BATCH))
  np.testing.assert_array_equal(np.asarray(batch["t"][1].b[1]), 5 * np.arange(BATCH))


def test_hosts_batches_of_another_structure_are_invalid_argument():
  feed, streams = make_feed(fake={1: {"structure": {"x": [0]}}})
  with pytest.raises(sidecar.InvalidArgumentError, match="hosts' batches differ in structure"):
    next(feed)
  assert all(s.closed for s in streams.values())


def test_a_feed_resumed_from_state_continues_with_the_next_batch():
  feed, _ = make_feed()
  with feed:
    for _ in range(5):
      next(feed)
    state = feed.state()
  resumed, streams = make_feed(state=state)
  with resumed:
    assert all(s.position == 5 for s in streams.values())  # each host starts there
    np.testing.assert_array_equal(np.asarray(next(resumed)["x"]), np.arange(40, 48))
  with pytest.raises(sidecar.InvalidArgumentError, match="resume with the same pipeline and seed"):
    make_feed(state=state, seed=1)


def test_an_interrupted_batch_loses_no_host_part():
  feed, _ = make_feed(fake={1: {"interrupt_at": 1}})  # host 1, the second part of batch 1
  with feed:
    next(feed)
    with pytest.raises(KeyboardInterrupt):
      next(feed)
    np.testing.assert_array_equal(np.asarray(next(feed)["x"]), np.arange(8, 16))
    np.testing.assert_array_equal(np.asarray(next(feed)["x"]), np.arange(16, 24))


def test_ctrl_c_after_a_batchs_parts_were_read_keeps_the_batch_for_the_next_next():
  feed, _ = make_feed(fake={1: {"sigint_at": 1}})  # as host 1's part of batch 1 is read
  with feed:
    next(feed)
    with pytest.raises(KeyboardInterrupt):
      next(feed)
    assert feed.state()["position"] == 1  # the kept batch is not the trainer's yet
    np.testing.assert_array_equal(np.asarray(next(feed)["x"]), np.arange(8, 16))
    assert feed.state()["position"] == 2
    np.testing.assert_array_equal(np.asarray(next(feed)["x"]), np.arange(16, 24))
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_lost_host_closes_every_stream_and_the_feed():
  feed, streams = make_feed(fake={1: {"fail_at": 2}})
  next(feed), next(feed)
  with pytest.raises(sidecar.HostLostError):
    next(feed)
  assert all(s.closed for s in streams.values())
  with pytest.raises(sidecar.ClosedError, match="is closed"):
    next(feed)


def test_the_end_of_the_data_ends_the_iteration_and_closes():
  feed, streams = make_feed(fake={0: {"batches": 2}, 1: {"batches": 2}})
  assert len(list(feed)) == 2
  assert feed.status is feed_lib.State.CLOSED and all(s.closed for s in streams.values())


class _Host:
  def __init__(self, host_id, pipelines):
    self.host_id, self.pipelines = host_id, pipelines


@pytest.mark.parametrize("options,kwargs,error,match", [
    ({"prefetch": 4}, {}, sidecar.InvalidArgumentError, r"options must be a sidecar.FeedOptions"),
    (None, {"global_batch_size": 2.5}, sidecar.InvalidArgumentError,
     r"global_batch_size must be a positive int, got 2.5"),
    (None, {"num_epochs": 0}, sidecar.InvalidArgumentError, r"num_epochs must be None or >= 1"),
    (None, {"name": "nope"}, sidecar.NotRegisteredError,
     r"no pipeline named 'nope' is registered on hosts \[1\]; registered pipelines: ids, nope\. "
     r"Register it with @sidecar.pipeline in a module the sidecars import: --import MODULE on "
     r"the command that starts them \(sidecar launch, sidecar local or sidecar serve\), or "
     r"LocalCluster\(imports=\[MODULE\]\)$"),
    (None, {"name": "idz"}, sidecar.NotRegisteredError,  # issue 71 item 3: names --import
     r"on hosts \[0, 1\]; registered pipelines: ids, nope \(did you mean 'ids'\?\)\. "
     r"Register it .* --import MODULE"),
], ids=["options-dict", "float-batch", "zero-epochs", "missing-pipeline", "mistyped-pipeline"])
def test_feed_arguments_are_checked_before_anything_opens(options, kwargs, error, match):
  hosts = [_Host(0, ("ids", "nope")), _Host(1, ("ids",))]
  args = {"name": "ids", "global_batch_size": 8, "num_epochs": None} | kwargs
  with pytest.raises(error, match=match):
    feed_lib.check_arguments(args.pop("name"), options, hosts, **args)


def test_feed_arguments_give_the_options_to_use():
  hosts = [_Host(0, ("ids",))]
  given = sidecar.FeedOptions(prefetch=3)
  assert feed_lib.check_arguments("ids", given, hosts, global_batch_size=8,
                                  num_epochs=2) is given
  assert feed_lib.check_arguments("ids", None, hosts, global_batch_size=8,
                                  num_epochs=None) == sidecar.FeedOptions()


def test_options_given_the_old_way_are_checked_and_become_feed_options():
  with pytest.warns(DeprecationWarning, match=r"options=sidecar.FeedOptions\(workers=2\)"):
    kwargs, options = arguments.split_legacy_feed("ids", {"n": 1}, None, {"workers": 2},
                                                  arguments.FEED_OPTIONS)
  assert options == sidecar.FeedOptions(workers=2) and kwargs == {"n": 1}
  with pytest.raises(sidecar.InvalidArgumentError, match="prefetch must be"), \
      pytest.warns(DeprecationWarning):
    arguments.split_legacy_feed("ids", None, None, {"prefetch": 0}, arguments.FEED_OPTIONS)


def test_processes_sharing_a_host_each_get_a_part_of_their_own():
  devices = jax.devices()[:4]  # one host; devices 0-1 of process 0, 2-3 of process 1
  sharding = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))
  owners = {d.id: i // 2 for i, d in enumerate(devices)}
  plans = jax_feed.plan(sharding, BATCH, {d.id: 0 for d in devices}, owners)
  assert [(p.host_id, p.process, p.ranges) for p in plans] == [
      (0, 0, ((0, 2), (2, 4))), (0, 1, ((4, 6), (6, 8)))]
  assert [d for p in plans for ds in p.devices for d in ds] == devices
  # Without owners (one process drives every device) the host is one part.
  (whole,) = jax_feed.plan(sharding, BATCH, {d.id: 0 for d in devices})
  assert whole.process == -1 and whole.ranges == ((0, 2), (2, 4), (4, 6), (6, 8))


@pytest.mark.parametrize("size,axes,match", [
    (6, ("data",), r"splits the batch into 4 shards; use a multiple of 4 \(4 or 8\)"),
    (3, ("data",), r"use a multiple of 4 \(4\)$"),
    (6, ("data", "model"), r"splits the batch into 8 shards; use a multiple of 8 \(8\)"),
], ids=["four", "below-one-shard", "two-axes"])
def test_a_batch_the_devices_do_not_divide_says_which_multiple_to_use(size, axes, match):
  devices = np.array(jax.devices()[:8]).reshape(4, 2) if len(axes) == 2 else np.array(
      jax.devices()[:4])
  sharding = NamedSharding(Mesh(devices, ("data", "model")[:devices.ndim]), P(axes))
  with pytest.raises(sidecar.InvalidArgumentError, match=match):
    jax_feed.plan(sharding, size, {d.id: 0 for d in devices.flat})
