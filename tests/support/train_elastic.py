"""A trainer for ``sidecar launch --elastic``: restores what it finds, trains on, saves.

Run as ``sidecar launch --hosts 3 --elastic --import tests.support.feed_fns -- python -m
tests.support.train_elastic DIR [KILL_AT]``. On every start it restores the latest
committed step in DIR, if there is one, with its data position, and reopens its feed from
there; it trains to step ``STEPS - 1``, saving every 2 steps (each save waits until it is
durable, so a step it reports committed is committed). With KILL_AT, on the first start
(``SIDECAR_RESTART=0``) process 1 SIGKILLs its own sidecar before batch KILL_AT, and the
launcher restarts the job on the other hosts. Each process prints ``RESULT {...}`` lines
(JSON, with its process index, host and restart count), and ``t`` fields (``time.time()``)
where the phases of a restart end, for benchmarks/elastic_launch.py.
"""

import time

T_START = time.time()  # before the imports: they are part of a restart's cost

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

STEPS = 9
SAVE_EVERY = 2
GLOBAL_BATCH = 12  # rows of the state too: divisible by 3 and by 2 processes


def main(directory: str, kill_at: str = "-1") -> int:
  import sidecar
  t_import = time.time()
  sidecar.jax.initialize()
  t_init = time.time()
  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  restart = int(os.environ.get("SIDECAR_RESTART", "0"))
  me = jax.process_index()
  ctl = sidecar.jax.Controller.from_env(timeout=60)
  t_ctl = time.time()
  host = ctl.local_hosts[0]

  def emit(kind, **fields):
    print("RESULT " + json.dumps({"kind": kind, "process": me, "host": host,
                                  "restart": restart, **fields}, sort_keys=True), flush=True)

  def gathered(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  emit("start", processes=jax.process_count(), pid=os.getpid(), t_start=T_START,
       t_import=t_import, t_init=t_init, t_ctl=t_ctl,
       sidecar_pids={str(h.host_id): h.pid for h in ctl.hosts})
  mesh = Mesh(np.array(jax.devices()), ("data",))
  rows = NamedSharding(mesh, P("data"))
  target = {"w": jax.ShapeDtypeStruct((GLOBAL_BATCH, 4), jnp.float32, sharding=rows),
            "step": np.int32(0)}

  @jax.jit
  def step(state, batch):
    return state + batch["x"] * 2 + 1

  try:
    # SIDECAR_TEST_REPLICAS=1: each host's shards also go to the next host's arena, so a
    # lost host's shards come back from a survivor's memory.
    replicas = int(os.environ.get("SIDECAR_TEST_REPLICAS", "0")) if len(ctl.hosts) > 1 else 0
    ckpt = ctl.checkpointer(directory, replicas=replicas)
    data_state = None
    if ckpt.latest_step() is not None:
      restored = ckpt.restore(target=target)
      state, first = restored["w"], int(restored["step"]) + 1
      data_state = ckpt.data_state()
      emit("restored", step=first - 1, steps=ckpt.all_steps(), data_state=data_state,
           w=gathered(state).tolist(), t=time.time(),
           sources=ckpt.last_restore_stats().shards)
    else:
      state, first = jax.device_put(jnp.zeros((GLOBAL_BATCH, 4), jnp.float32), rows), 0
    with ctl.feed("ids", kwargs={"n": 1000}, global_batch_size=GLOBAL_BATCH, sharding=rows,
                  state=data_state) as feed:
      for i in range(first, STEPS):
        if restart == 0 and me == 1 and i == int(kill_at):
          own = next(h.pid for h in ctl.hosts if h.host_id == host)
          emit("kill", step=i, pid=own, t=time.time())
          os.kill(own, signal.SIGKILL)
        batch = next(feed)
        state = step(state, batch)
        ids = gathered(batch["id"]).tolist()
        emit("batch", i=i, ids=ids, t=time.time())  # after the step: the first one's end
        if i % SAVE_EVERY == SAVE_EVERY - 1:
          handle = ckpt.save(i, {"w": state, "step": np.int32(i)}, data_state=feed.state())
          handle.durable.result()
          handle.replicated.result()
          emit("committed", step=i, w=gathered(state).tolist())
    emit("final", w=gathered(state).tolist(), steps=ckpt.all_steps())
    ckpt.close()
  finally:
    ctl.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
