"""/metrics on a LocalCluster, scraped over HTTP while it feeds and saves."""

import gc

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.conftest import eventually
from tests.support.metrics import samples, scrape, total, value

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="32MiB",
                                    imports=["tests.support.feed_fns"], metrics=True) as c:
    yield c


def scrape_all(cluster) -> list[dict]:
  return [samples(scrape(url)) for url in cluster.metrics_urls]


def test_counters_move_during_a_feed_and_a_save_and_gauges_return_to_zero(cluster, tmp_path):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
  before = scrape_all(cluster)
  with cluster.controller() as ctl:
    with ctl.feed("ids", kwargs={"n": 64}, global_batch_size=8, sharding=sharding,
                  options=sidecar.FeedOptions(prefetch=2)) as feed:
      batches = [next(feed) for _ in range(3)]
      during = scrape_all(cluster)
      for found in during:
        assert value(found, "sidecar_feeds_running", pipeline="ids") == 1
        assert value(found, "sidecar_calls_in_flight", kind="feed") == 1
        assert total(found, "sidecar_arena_leased_bytes") > 0  # batches the trainer holds
        assert value(found, "sidecar_workers_connected") == 1
    del batches
    state = {"w": jax.device_put(np.arange(4096, dtype=np.float32), sharding)}
    with ctl.checkpointer(tmp_path / "ck", replicas=1) as ckpt:
      ckpt.save(1, state)
      ckpt.wait()
      for url in cluster.metrics_urls:  # each host holds the other's replica
        assert eventually(lambda url=url: value(samples(scrape(url)), "sidecar_ram_tier_steps",
                                                kind="replica") == 1)
      restored = ckpt.restore(1, target=state)
      np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
      del restored
      gc.collect()
      after = scrape_all(cluster)
      for old, new in zip(before, after):
        assert value(new, "sidecar_feed_batches_total", pipeline="ids") >= value(
            old, "sidecar_feed_batches_total", pipeline="ids") + 3
        # A feed its trainer closed ended OK (before: often CANCELLED).
        assert value(new, "sidecar_calls_total", kind="feed", name="ids", code="OK") >= 1
        assert value(new, "sidecar_calls_total", kind="feed", name="ids", code="CANCELLED") == 0
        assert value(new, "sidecar_checkpoint_bytes_total", what="staged") >= 8192
        assert value(new, "sidecar_checkpoint_bytes_total", what="written") >= 8192
        assert value(new, "sidecar_call_seconds_count", name="sidecar.ckpt.stage") >= 1
        assert value(new, "sidecar_checkpoint_background_seconds_count", work="write") == 1
        assert value(new, "sidecar_checkpoint_bytes_total", what="replicated") == 8192
        assert value(new, "sidecar_checkpoint_background_seconds_count", work="replicate") == 1
        # The old name, until 0.4.0 (a dashboard that reads it keeps working).
        assert value(new, "sidecar_checkpoint_phase_seconds_count", phase="replicate") == 1
        assert value(new, "sidecar_ram_tier_bytes", kind="replica") == 8192
        assert value(new, "sidecar_ram_tier_steps", kind="own") == 1
        assert value(new, "sidecar_ram_tier_bytes", kind="own") == 8192
        assert total(new, "sidecar_restore_bytes_total") >= 8192
        assert value(new, "sidecar_checkpoint_writing_steps") == 0
        assert value(new, "sidecar_feeds_running", pipeline="ids") == 0
        assert value(new, "sidecar_calls_in_flight", kind="feed") == 0
  # The controller is closed: its workers detached, every lease went back. What stays is
  # the replica link of each host's peer (server/checkpoint/links.Links keeps it between steps).
  for url in cluster.metrics_urls:
    assert eventually(lambda url=url: total(samples(scrape(url)),
                                            "sidecar_arena_leased_bytes") == 0)
  for found in scrape_all(cluster):
    assert value(found, "sidecar_workers_connected") == 1
    assert all(value(found, "sidecar_calls_in_flight", kind=k) == 0
               for k in ("call", "stream", "feed"))
