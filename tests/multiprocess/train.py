"""A trainer that runs unchanged as one process or as N under ``jax.distributed``.

One process (``python -m tests.multiprocess.train single DIR``): a LocalCluster of 2
hosts x 2 devices in this process. N processes (``sidecar launch --hosts 2
--devices-per-host 2 --import tests.feed_fns -- python -m tests.multiprocess.train
multi DIR``): each process beside its own sidecar. Either way it feeds integer-valued
batches into a jitted step, saves, restores, resumes the feed, and (process 0) prints
one JSON line a record, ``RESULT {...}``, for the tests to compare across modes.
"""

import json
import os
import sys

import numpy as np


def main(mode: str, directory: str, scenario: str = "train") -> int:
  import sidecar
  if mode == "multi":
    sidecar.distributed.initialize()
  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  cluster = None
  if mode == "multi":
    ctl = sidecar.Controller.from_env(timeout=60)
  else:
    cluster = sidecar.testing.LocalCluster(2, 2, imports=["tests.feed_fns"]).start()
    ctl = cluster.controller()
  me = jax.process_index()

  def emit(kind, **fields):
    if me == 0:
      print("RESULT " + json.dumps({"kind": kind, **fields}, sort_keys=True), flush=True)

  def gathered(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  mesh = Mesh(np.array(jax.devices()).reshape(4), ("data",))
  rows = NamedSharding(mesh, P("data"))
  state = jax.device_put(jnp.zeros((8, 4), jnp.float32), rows)

  @jax.jit
  def step(state, batch):
    return state + batch["x"][:8] * 2 + 1

  emit("identity", processes=jax.process_count(), local_hosts=ctl.local_hosts,
       device_hosts={str(k): v for k, v in sorted(ctl.device_hosts.items())})
  if scenario == "call":
    results = ctl.call("echo", me) if "echo" in ctl.hosts[0].functions else []
    emit("call", results=results)
  ckpt = ctl.checkpointer(directory, max_to_keep=2)
  saved_at = None
  with ctl.feed("ids", global_batch_size=16, sharding=rows, seed=7, n=200) as feed:
    for i in range(6):
      batch = next(feed)
      emit("batch", i=i, ids=gathered(batch["id"]).tolist(), state=feed.state())
      state = step(state, batch)
      if i in (2, 4):
        ckpt.save(i, {"w": state, "step": np.int32(i)}, data_state=feed.state())
        saved_at, saved = i, gathered(state)
  ckpt.wait()
  emit("saved", steps=ckpt.all_steps(), state=gathered(state).tolist())
  target = {"w": jax.ShapeDtypeStruct(state.shape, state.dtype, sharding=rows),
            "step": np.int32(0)}
  restored = ckpt.restore(target=target)
  emit("restored", step=int(restored["step"]), same=bool(
      np.array_equal(gathered(restored["w"]), saved)),
      data_state=ckpt.data_state())
  with ctl.feed("ids", global_batch_size=16, sharding=rows, seed=7, n=200,
                state=ckpt.data_state()) as feed:
    batch = next(feed)
    emit("resumed", after=saved_at, ids=gathered(batch["id"]).tolist())
  ckpt.close()
  ctl.close()
  if cluster is not None:
    cluster.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
