"""A trainer that runs unchanged as one process or as N under ``jax.distributed``.

One process (``python -m tests.support.train single DIR SCENARIO``): a
LocalCluster of 2 hosts x 2 devices in this process. N processes (``sidecar launch
--hosts 2 --devices-per-host 2 --import tests.support.feed_fns -- python -m
tests.support.train multi DIR SCENARIO``): each process beside its own sidecar.
Each process prints ``RESULT {...}`` lines (JSON, with its process index) for the
tests to compare across processes and modes.
"""

import json
import os
import signal
import sys

import numpy as np


def main(mode: str, directory: str, scenario: str = "train") -> int:
  import sidecar
  if mode == "multi":
    sidecar.jax.initialize()
  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  cluster = None
  if mode == "multi":
    ctl = sidecar.jax.Controller.from_env(timeout=60)
  else:
    cluster = sidecar.testing.LocalCluster(2, 2, imports=["tests.support.feed_fns"]).start()
    ctl = cluster.controller()
  me = jax.process_index()

  def emit(kind, **fields):
    print("RESULT " + json.dumps({"kind": kind, "process": me, **fields}, sort_keys=True),
          flush=True)

  def gathered(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  mesh = Mesh(np.array(jax.devices()).reshape(4), ("data",))
  rows = NamedSharding(mesh, P("data"))
  state = jax.device_put(jnp.zeros((8, 4), jnp.float32), rows)
  target = {"w": jax.ShapeDtypeStruct(state.shape, state.dtype, sharding=rows),
            "bias": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P())),
            "step": np.int32(0)}

  @jax.jit
  def step(state, batch):
    return state + batch["x"][:8] * 2 + 1

  emit("identity", processes=jax.process_count(), local_hosts=ctl.local_hosts,
       device_hosts={str(k): v for k, v in sorted(ctl.device_hosts.items())},
       calls=ctl.call("sidecar_pid"),
       status=[[s.identity.host_id, s.identity.process_index, list(s.identity.device_ids)]
               for s in ctl.status()])

  try:
    if scenario == "disagree_step":
      ckpt = ctl.checkpointer(directory)
      ckpt.save(10 + me, {"w": state}).durable.result()
    elif scenario == "disagree_feed":
      ctl.feed("ids", kwargs={"n": 200}, global_batch_size=16, sharding=rows, seed=me)
    elif scenario == "iter":
      with ctl.feed("shard_ids", kwargs={"n": 64}, global_batch_size=8, sharding=rows) as feed:
        for i in range(3):
          batch = next(feed)
          emit("batch", i=i, ids=gathered(batch["id"]).tolist(), state=feed.state())
      with ctl.feed("shard_ids", kwargs={"n": 64}, global_batch_size=8, sharding=rows,
                    state=feed.state()) as again:
        emit("resumed", ids=gathered(next(again)["id"]).tolist())
    elif scenario in ("train", "restore"):
      ckpt = ctl.checkpointer(directory, max_to_keep=2)
      if scenario == "restore":  # a new job on the steps a previous one left
        restored = ckpt.restore(target=target)
        emit("restored", steps=ckpt.all_steps(), step=int(restored["step"]),
             w=gathered(restored["w"]).tolist(), data_state=ckpt.data_state())
      else:
        train(ctl, ckpt, state, step, rows, mesh, target, emit, gathered, directory)
      ckpt.close()
    else:
      raise ValueError(f"unknown scenario {scenario!r}")
  except sidecar.SidecarError as e:
    emit("error", type=type(e).__name__, message=str(e))
    return 3
  finally:
    ctl.close()
    if cluster is not None:
      cluster.close()
  return 0


def train(ctl, ckpt, state, step, rows, mesh, target, emit, gathered, directory):
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding, PartitionSpec as P

  bias = jax.device_put(jnp.arange(4, dtype=jnp.float32), NamedSharding(mesh, P()))
  saved_at = saved = None
  # Fault injection: "trainer@I" SIGKILLs process 1 as it would save at batch I; "sidecar@I"
  # has process 1 SIGKILL its own sidecar before batch I. Saves then wait to be durable, so the
  # step before is surely committed.
  fault, _, at = os.environ.get("SIDECAR_TEST_FAULT", "").partition("@")
  at = int(at) if at else -1
  me = jax.process_index()
  with ctl.feed("ids", kwargs={"n": 200}, global_batch_size=16, sharding=rows, seed=7) as feed:
    for i in range(6):
      if fault == "sidecar" and i == at and me == 1:
        os.kill(ctl.hosts[1].pid, signal.SIGKILL)
      batch = next(feed)
      emit("batch", i=i, ids=gathered(batch["id"]).tolist(), state=feed.state())
      state = step(state, batch)
      if i in (1, 2, 4):
        if fault == "trainer" and i == at and me == 1:
          os.kill(os.getpid(), signal.SIGKILL)  # process 0 is in the save already
        handle = ckpt.save(i, {"w": state, "bias": bias, "step": np.int32(i)},
                           data_state=feed.state())
        handle.staged.result()
        saved_at, saved = i, gathered(state)
        emit("staged", step=i, w=saved.tolist())
        if fault:
          handle.durable.result()
  ckpt.wait()
  emit("saved", steps=ckpt.all_steps(), w=saved.tolist())
  restored = ckpt.restore(target=target)
  emit("restored", step=int(restored["step"]), same=bool(
      np.array_equal(gathered(restored["w"]), saved)), bias=gathered(restored["bias"]).tolist(),
      data_state=ckpt.data_state())
  with ctl.feed("ids", kwargs={"n": 200}, global_batch_size=16, sharding=rows, seed=7,
                state=ckpt.data_state()) as feed:
    emit("resumed", after=saved_at, ids=gathered(next(feed)["id"]).tolist())
  # Stock Orbax restores the same step in every process, onto the same shardings.
  with ocp.CheckpointManager(directory) as mngr:
    stock = mngr.restore(saved_at, args=ocp.args.StandardRestore(
        {"w": target["w"], "bias": target["bias"],
         "step": jax.ShapeDtypeStruct((), jnp.int32)}))
  emit("orbax", same=bool(np.array_equal(gathered(stock["w"]), saved)),
       step=int(stock["step"]))


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
