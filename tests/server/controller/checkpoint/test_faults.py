"""A save that fails in an in-process sidecar (a full disk): everything comes back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.conftest import eventually
from tests.support.states import abstract

pytestmark = pytest.mark.server


def test_a_save_that_fails_on_a_full_disk_releases_everything_and_the_next_save_works(
    make_server, tmp_path, monkeypatch):
  """ENOSPC once step 2's first shard is on disk ("enospc@2"): step 2 fails, the trainer's
  arena copy and the sidecar's staged blocks come back, and step 3 saves and restores."""
  from sidecar._src.host.checkpoint.faults import FAULT_ENV
  monkeypatch.setenv(FAULT_ENV, "enospc@2")  # read by the in-process sidecar as it writes
  server = make_server(shm_size=16 << 20, device_ids=(0,))
  one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P())

  def state(value):
    return {"w": jax.device_put(jnp.full((256, 128), value, jnp.float32), one),
            "n": np.arange(4) + int(value)}
  with sidecar.Controller([f"127.0.0.1:{server.port}"]) as ctl, \
      ctl.checkpointer(tmp_path / "ck", replicas=0) as ckpt:
    ckpt.save(1, state(1.0)).durable.result(60)
    held = server.leases.allocator.used_bytes  # step 1 in the RAM tier
    with pytest.raises(sidecar.SidecarError, match="No space left on device"):
      ckpt.save(2, state(2.0)).durable.result(60)
    assert eventually(lambda: ctl.worker(0).live_blocks == 0)
    assert eventually(lambda: server.leases.allocator.used_bytes <= held)
    assert ckpt.all_steps() == [1]
    ckpt.save(3, state(3.0)).durable.result(60)  # the disk has room again: no fault at 3
    assert ckpt.all_steps() == [1, 3]
    restored = ckpt.restore(3, target=abstract(state(3.0)))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((256, 128), 3.0))
    np.testing.assert_array_equal(restored["n"], np.arange(4) + 3)
  assert not any((tmp_path / "ck").glob("2*"))
