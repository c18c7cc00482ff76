"""Issue 55 item 1: a job that resumes can make its first save.

The README's pattern: save a state of over 45% of a host's arena, restore it, compute the
next state with a jitted step (rebinding ``state``), save. The restored arrays map their
arena blocks (the CPU backend aliases them), and JAX lets go of an aliased array's memory
only at its next garbage collection of Python references: before, the save failed with
ResourceExhaustedError ("worker session ... holds 20.0 MiB of the arena ... free arrays
sooner") though the trainer held nothing. Now an alloc that finds no room first lets go of
what nothing references, and asks again.
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar

pytestmark = pytest.mark.processes


@pytest.mark.timeout(240)
def test_a_resumed_job_saves_a_state_over_half_its_arena(tmp_path):
  n = (20 << 20) * 2 // 4  # 20 MiB on each host, of 32 MiB arenas (quota 0.9: 28.8 MiB)
  gc.disable()  # a release must not wait for the collector to run by chance
  try:
    with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2,
                                      shm_size="32MiB") as cluster:
      with cluster.controller() as ctl:
        rows = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), P("data"))
        step = jax.jit(lambda s: {"w": s["w"] + 1})
        ckpt = ctl.checkpointer(str(tmp_path / "ckpt"), max_to_keep=3)
        state = {"w": jax.device_put(jnp.zeros(n, jnp.float32), rows)}
        ckpt.save(0, state)
        ckpt.wait()
        del state
        state = ckpt.restore(0, target={
            "w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=rows)})
        assert ctl.worker(0).live_blocks > 0  # the restored arrays map their blocks
        state = step(state)
        ckpt.save(1, state)
        ckpt.wait()
        assert ckpt.all_steps() == [0, 1]
        restored = ckpt.restore(1, target={
            "w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=rows)})
        np.testing.assert_array_equal(np.asarray(restored["w"][:8]), np.ones(8, np.float32))
        del restored, state
        ckpt.close()
  finally:
    gc.enable()
