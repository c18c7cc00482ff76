# examples/train_multiprocess.py: the same trainer as one process per host or one for all.
# From examples/: sidecar launch --hosts 2 --devices-per-host 2 --import quickstart_fns
#   --checkpoint-root /tmp/ckpt -- python train_multiprocess.py /tmp/ckpt/run1
import sys

import sidecar

sidecar.jax.initialize()     # before any other JAX call; a no-op without a job
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

directory = sys.argv[1]              # under one of the sidecars' --checkpoint-root


@jax.jit
def train_step(state, batch):        # any jitted step; here, a running sum
  return {"w": state["w"] + batch["image"].mean(axis=(1, 2, 3)) + batch["label"]}


with sidecar.jax.Controller.from_env() as ctl:    # every sidecar; drives this process's own host
  sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
  abstract_state = {"w": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=sharding)}
  init_state = jax.jit(lambda: {"w": jnp.zeros(64)}, out_shardings={"w": sharding})
  ckpt = ctl.checkpointer(directory, max_to_keep=3)
  start = ckpt.latest_step()
  state = ckpt.restore(target=abstract_state) if start is not None else init_state()
  first = 0 if start is None else start + 1
  with ctl.feed("images", global_batch_size=64, sharding=sharding,
                state=ckpt.data_state() if start is not None else None) as feed:
    for step, batch in zip(range(first, first + 100), feed):
      state = train_step(state, batch)
      if step % 25 == 24:
        ckpt.save(step, state, data_state=feed.state())
  ckpt.close()                        # waits for the last save to be durable
  if jax.process_index() == 0:
    print(f"{jax.process_count()} process(es): trained steps {first}-{step}; "
          f"saved steps {ckpt.all_steps()}")
