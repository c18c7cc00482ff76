"""Save, then at once a jitted step that donates the saved arrays, then restore bit-exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import sidecar
from sidecar._src.jax import checkpoint as jax_checkpoint

pytestmark = pytest.mark.accelerator

LEAVES, WIDTH = 8, 4096
bump = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  root = tmp_path_factory.mktemp("checkpoints")
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="2560MiB",
                                    checkpoint_roots=[str(root)]) as c:
    yield c, root


def make_state(nbytes: int, device) -> dict[str, jax.Array]:
  """``LEAVES`` float32 arrays of ``nbytes`` in all, a bf16 one and an int32 step, made on
  ``device``."""
  rows = nbytes // LEAVES // 4 // WIDTH
  on = SingleDeviceSharding(device)
  normal = jax.jit(lambda k: jax.random.normal(k, (rows, WIDTH)), out_shardings=on)
  keys = jax.random.split(jax.random.key(0), LEAVES + 1)
  state = {f"w{i}": normal(k) for i, k in enumerate(keys[:LEAVES])}
  state["bf16"] = jax.device_put(jax.random.normal(keys[-1], (256, 256), jnp.bfloat16), device)
  state["step"] = jax.device_put(jnp.int32(41), device)
  return jax.block_until_ready(state)


def bits(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("nbytes, ram_steps, piece_bytes", [
    (4 << 20, 1, None), (4 << 20, 0, None), (1 << 30, 1, None), (64 << 20, 1, 1 << 20)],
    ids=["4MiB-ram-tier", "4MiB-storage", "1GiB-ram-tier", "64MiB-in-1MiB-pieces"])
@pytest.mark.timeout(600)
def test_a_donating_step_right_after_save_leaves_the_saved_step_bit_exact(
    cluster, nbytes, ram_steps, piece_bytes, monkeypatch):
  if piece_bytes is not None:  # each 8 MiB leaf's device-to-host in 8 pieces
    monkeypatch.setattr(jax_checkpoint, "PIECE_BYTES", piece_bytes)
  c, root = cluster
  device = jax.devices()[0]
  state = make_state(nbytes, device)
  if piece_bytes is not None:  # its split compiled first: a later save's way, in pieces
    jax_checkpoint.save_leaves(state)
    assert jax_checkpoint.wait_for_splits(120)
  # The others are their layout's first save in this process (4MiB-storage its second):
  # whole copies on the device while the split compiles on a thread.
  expected = jax.device_get(copy(state))  # other arrays: the saved ones keep no host copy
  given = jax.tree.leaves(state)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
  with c.controller() as ctl, ctl.checkpointer(root / f"ck-{nbytes}-{ram_steps}-{piece_bytes}",
                                               ram_steps=ram_steps) as ckpt:
    handle = ckpt.save(7, state)
    for _ in range(3):
      state = bump(state)  # at once: donates the arrays save() was given
    jax.block_until_ready(state)
    assert all(a.is_deleted() for a in given)  # the step did take them
    del given
    handle.durable.result(timeout=300)
    restored = ckpt.restore(7, target=target)
    sources = set(ckpt.last_restore_stats().shards)
  assert sources == ({"ram:host0"} if ram_steps else {"storage"})
  for name, want in expected.items():
    got = np.asarray(restored[name])
    assert got.dtype == want.dtype and bits(got).tobytes() == bits(want).tobytes(), name
  assert int(state["step"]) == 44  # and the trainer's own state went on
