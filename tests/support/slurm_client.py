"""A one-process client of a ``sidecar slurm service``: joins it through its cluster file
and trains under ``sidecar.elastic.retry(grow=True)``.

``python -m tests.support.slurm_client CLUSTER_FILE DIR [KILL_AT]``: 2 CPU devices, one per
host of the service (``--devices-per-host 1``). With KILL_AT it SIGKILLs host 1's sidecar
before that step; the service requeues its array task, whose sidecar comes back at the
same address, and the client waits for it two steps later, so that the next save grows
the job back to both hosts. Prints ``RESULT {...}`` lines: the ids of every step's batch,
the final state and the events of the retry.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import numpy as np  # noqa: E402

STEPS = 8
BATCH = 8


def emit(kind, **fields):
  print("RESULT " + json.dumps({"kind": kind, **fields}, sort_keys=True), flush=True)


def main(cluster_file: str, directory: str, kill_at: str = "-1") -> int:
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import sidecar
  from sidecar import elastic

  ctl = sidecar.jax.Controller.from_cluster_file(cluster_file, timeout=60)
  emit("hosts", hosts=[h.host_id for h in ctl.hosts], pids=[h.pid for h in ctl.hosts])
  seen: dict[int, list[int]] = {}
  killed: list[int] = []

  @elastic.retry(ctl, min_hosts=1, grow=True)
  def train(hosts):
    rows = NamedSharding(Mesh(np.array(elastic.devices(ctl, hosts)), ("data",)), P("data"))
    ckpt = ctl.checkpointer(directory, max_to_keep=2, replicas=min(1, len(hosts) - 1))
    start = ckpt.latest_step()
    if start is None:
      w, data, start = jax.device_put(jnp.zeros((BATCH,), jnp.float32), rows), None, 0
    else:
      w = ckpt.restore(target={"w": jax.ShapeDtypeStruct((BATCH,), jnp.float32,
                                                         sharding=rows)})["w"]
      data = ckpt.data_state()
    with ctl.feed("ids", kwargs={"n": 600}, global_batch_size=BATCH, sharding=rows, seed=3,
                  state=data) as feed:
      for step in range(start + 1, STEPS + 1):
        if step == int(kill_at) and not killed:
          killed.append(next(h.pid for h in ctl.hosts if h.host_id == 1))
          os.kill(killed[0], signal.SIGKILL)
          emit("killed", step=step, pid=killed[0])
        if killed and step == int(kill_at) + 2 and len(hosts) == 1:
          deadline = time.monotonic() + 120
          while 1 not in [h.host_id for h in ctl.hosts] and time.monotonic() < deadline:
            time.sleep(0.2)
          emit("back", step=step, hosts=[h.host_id for h in ctl.hosts])
        batch = next(feed)
        seen[step] = np.asarray(batch["id"]).tolist()
        w = w + batch["id"].astype(jnp.float32)
        if step % 2 == 0:
          ckpt.save(step, {"w": w}, data_state=feed.state())
          ckpt.wait()
    ckpt.close()
    return np.asarray(w).tolist(), hosts

  try:
    w, hosts = train()
  finally:
    ctl.close()
  emit("final", w=w, hosts=list(hosts), seen={str(k): v for k, v in sorted(seen.items())},
       events=[e.kind for e in train.events])
  return 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
