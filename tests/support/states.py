"""Checkpoint test states: one made on some devices, its restore target, leaf-by-leaf equality."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def state_on(devices):
  """A state sharded over ``devices`` (1536 rows: a shard per device), a replicated leaf and a
  NumPy one."""
  mesh = Mesh(np.array(devices), ("data",))
  w = jnp.arange(1536 * 64, dtype=jnp.float32).reshape(1536, 64)
  return {"w": jax.device_put(w, NamedSharding(mesh, P("data"))),
          "b": jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P())),
          "table": np.arange(10, dtype=np.int64)}


def target_on(devices, like):
  """``state_on``'s restore target on other ``devices``: its jax leaves as ShapeDtypeStructs."""
  mesh = Mesh(np.array(devices), ("data",))
  specs = {"w": P("data"), "b": P()}
  return {k: (jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
              if k in specs else v) for k, v in like.items()}


def abstract(tree):
  """``tree``'s restore target on its own shardings."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, tree)


def assert_same(a, b):
  """Equal leaf by leaf, values and dtypes."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.asarray(x).dtype == np.asarray(y).dtype
