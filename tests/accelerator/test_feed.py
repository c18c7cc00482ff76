"""Feed rows bit-exact on the chip under a small arena, with transfers in flight."""

import collections
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.support import accelerator_fns

pytestmark = pytest.mark.accelerator

FNS = ["tests.support.accelerator_fns"]
BATCH = 32  # rows of 224x224x3 uint8: 4.8 MB a batch, ~20 of them fill the arena
HELD = 8  # batches the trainer keeps on the device before it reads the oldest back


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="96MiB",
                                    imports=FNS) as c:
    yield c


def check(batch) -> list[int]:
  """The batch's ids, once each of its rows (read back from the device) is the row the
  pipeline made for its id."""
  ids, images = np.asarray(batch["id"]), np.asarray(batch["image"])
  wrong = [int(i) for i, image in zip(ids, images)
           if not np.array_equal(image, accelerator_fns.row(i))]
  assert not wrong, f"{len(wrong)} rows differ from what the pipeline made: ids {wrong[:10]}"
  return ids.tolist()


@pytest.mark.parametrize("workers", [0, min(4, os.cpu_count() or 1)], ids=["sidecar", "workers"])
@pytest.mark.timeout(600)
def test_rows_are_bit_exact_with_transfers_in_flight_under_a_96mib_arena(cluster, workers):
  device = jax.devices()[0]
  sharding = NamedSharding(Mesh(np.array([device]), ("data",)), P("data"))
  n, seen, on_device = BATCH * 60, [], collections.deque()
  with cluster.controller() as ctl, ctl.feed(
      "known_rows", kwargs={"n": n}, global_batch_size=BATCH, sharding=sharding, seed=5,
      num_epochs=1, options=sidecar.FeedOptions(workers=workers, prefetch=4)) as feed:
    for batch in feed:
      assert batch["image"].sharding.device_set == {device}
      on_device.append(batch)  # its copy to the device may still be in flight
      if len(on_device) > HELD:
        seen += check(on_device.popleft())
    while on_device:
      seen += check(on_device.popleft())
  assert sorted(seen) == list(range(n))  # every row once: none lost, none twice
