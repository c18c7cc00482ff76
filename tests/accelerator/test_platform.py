"""The sidecar and its feed workers never hold the chip: the trainer opens it after them."""

import jax
import numpy as np
import pytest
from jax._src import xla_bridge
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.accelerator.conftest import DRY_RUN

pytestmark = pytest.mark.accelerator

FNS = ["tests.support.accelerator_fns"]


@pytest.mark.timeout(600)
def test_the_sidecar_and_its_feed_workers_run_jax_on_the_cpu_and_the_trainer_gets_the_chip(
    accelerator):
  # The tier runs this before anything in this process opens the chip (its conftest).
  held_already = xla_bridge.backends_are_initialized()
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="96MiB",
                                    imports=FNS, configure_jax=False) as cluster, \
      cluster.controller() as ctl:
    pid = cluster.pid(0)
    # The sidecar opens JAX first, as a registered function may...
    assert ctl.call("jax_platform") == [{"platform": "cpu", "JAX_PLATFORMS": "cpu"}]
    # ...and the trainer opens the chip after it: a second process that held it would
    # have made this raise (libtpu's multi-process lockfile).
    device = jax.devices()[0]
    if not DRY_RUN:
      assert device.platform == accelerator["platform"], (held_already, device)
    # Feed workers start while the trainer holds the chip; each reports its own JAX.
    sharding = NamedSharding(Mesh(np.array([device]), ("data",)), P("data"))
    with ctl.feed("platforms", kwargs={"n": 256}, global_batch_size=32, sharding=sharding,
                  num_epochs=1, options=sidecar.FeedOptions(workers=2)) as feed:
      batches = [jax.device_get(b) for b in feed]
  assert len(batches) == 8
  assert np.concatenate([b["cpu"] for b in batches]).all(), batches
  makers = set(np.concatenate([b["pid"] for b in batches]).tolist())
  assert makers and pid not in makers  # the workers made them, not the sidecar
