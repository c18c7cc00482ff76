"""A trainer for ``sidecar launch --max-restarts``: saves, then fails on its first starts.

Run as ``sidecar launch --hosts 2 --max-restarts K -- python -m
tests.support.train_restarts DIR FAILS``. Every process of the job restores the latest
committed step in DIR if there is one (else starts from zeros), trains one step and saves
it (waiting until it is committed). Then, while ``SIDECAR_RESTART`` is below FAILS, process
1 fails: SIGKILL on the first start, exit code 3 on the later ones; else every process
ends with 0. Each process prints ``RESULT {json}`` lines: its start (with its sidecar's
pid), where its restore came from (``ram:hostN`` is the RAM tier of sidecar N), the step
it committed, and its failure.
"""

import json
import os
import signal
import sys

import numpy as np

ROWS = 4  # the state's rows: divisible by the 2 processes
EXIT_CODE = 3


def main(directory: str, fails: str) -> int:
  import sidecar
  sidecar.jax.initialize()
  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  restart = int(os.environ.get("SIDECAR_RESTART", "0"))
  me = jax.process_index()
  ctl = sidecar.jax.Controller.from_env(timeout=60)
  host = ctl.local_hosts[0]

  def emit(kind, **fields):
    print("RESULT " + json.dumps({"kind": kind, "process": me, "host": host,
                                  "restart": restart, **fields}, sort_keys=True), flush=True)

  try:
    emit("start", pid=os.getpid(), sidecar_pids={str(h.host_id): h.pid for h in ctl.hosts})
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    # Only the sharded array: each host's shard is in its own sidecar's RAM tier (a
    # replicated scalar is saved by one process, so the others would read it from storage).
    target = {"w": jax.ShapeDtypeStruct((ROWS, 2), jnp.float32, sharding=rows)}
    ckpt = ctl.checkpointer(directory)
    if (latest := ckpt.latest_step()) is not None:
      state, step = ckpt.restore(latest, target=target)["w"], latest + 1
      emit("restored", step=step - 1, sources=ckpt.last_restore_stats().shards)
    else:
      state, step = jax.device_put(jnp.zeros((ROWS, 2), jnp.float32), rows), 0
    state = jax.jit(lambda s: s + 1)(state)
    ckpt.save(step, {"w": state}).durable.result()
    w = np.asarray(multihost_utils.process_allgather(state, tiled=True)).tolist()
    emit("committed", step=step, w=w)
    # Every process has said so before process 1 fails (else the launcher may stop process
    # 0 before its line: seen once, on a loaded machine).
    multihost_utils.sync_global_devices("committed")
    if restart < int(fails) and me == 1:
      emit("fail", how="SIGKILL" if restart == 0 else f"exit {EXIT_CODE}")
      if restart == 0:
        os.kill(os.getpid(), signal.SIGKILL)
      os._exit(EXIT_CODE)  # as a crash: no clean shutdown of the job
    ckpt.close()
  finally:
    ctl.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
