"""A trainer for ``sidecar launch --max-restarts``: a feed with worker processes, killed.

Run as ``sidecar launch --hosts 1 --max-restarts K --import tests.support.feed_fns --
python -m tests.support.feed_restarts STEPS WORKERS FAILS [MARKER]``. On each start it reports its
sidecar's feeds, arena use (beyond the batches it keeps for re-done steps) and feed worker
processes (the last trainer's, kept idle for this one's feed) before it opens its own feed
(once no feed and no arena block of the last trainer is left, or what is left after
``LEFT_S``), opens
the ``ids`` feed with ``FeedOptions(workers=WORKERS)``, times STEPS steps (a jitted matmul
on each batch) and reports the steps/s and the feed worker processes then running. On the
first FAILS starts (``SIDECAR_RESTART`` below FAILS) it then SIGKILLs itself, with its
feed open: its Unix socket just drops, as a crashed trainer's. With MARKER, the feed is
``slow_while``'s and, before the kill, the trainer creates file MARKER and waits until its
workers are stuck in a minute-long example (the file is removed on the next start). Each
line it prints is
``RESULT {json}``, for tests/processes/tools/test_launch_restarts.py and
benchmarks/launch_restarts.py.
"""

import json
import os
import signal
import sys
import threading
import time

import numpy as np

BATCH, WIDTH = 64, 256
CHILD = "sidecar._src.server.feeds.child"  # how a feed worker process's command line reads
TENANT_CHILD = "sidecar._src.server.tenant_procs.feed_worker"  # a pool tenant's
LEFT_S = 10.0  # how long a start waits for the last trainer's feed to be gone from its sidecar


def feed_workers(sidecar_pid: int, child: str = CHILD) -> list[int]:
  """The feed worker processes of sidecar ``sidecar_pid`` that run (zombies excluded);
  ``child``: the module their command line runs (a pool tenant's: ``TENANT_CHILD``)."""
  pids = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      with open(f"/proc/{name}/cmdline", "rb") as f:
        command = f.read().decode(errors="replace")
    except OSError:
      continue  # gone meanwhile
    if int(fields[1]) == sidecar_pid and fields[0] != "Z" and child in command:
      pids.append(int(name))
  return sorted(pids)


def main(steps: str, workers: str, fails: str, marker: str = "") -> int:
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import sidecar

  restart = int(os.environ.get("SIDECAR_RESTART", "0"))

  def emit(kind, **fields):
    print("RESULT " + json.dumps({"kind": kind, "restart": restart, **fields}, sort_keys=True),
          flush=True)

  ctl = sidecar.jax.Controller.from_env(timeout=60)
  try:
    sidecar_pid = ctl.hosts[0].pid

    def left() -> tuple[int, int, list[int]]:
      status = ctl.status()[0]
      return (len(status.feeds), status.arena_used - status.arena_kept,
              feed_workers(sidecar_pid))

    # The launcher starts this trainer once the last one exited, not once its sidecar
    # ended that one's session and feed (threads there, which a loaded machine may run a
    # little later): what is still there after LEFT_S is left for good.
    deadline, seen = time.monotonic() + LEFT_S, left()
    while seen[:2] != (0, 0) and time.monotonic() < deadline:
      time.sleep(0.05)
      seen = left()
    emit("start", pid=os.getpid(), sidecar_pid=sidecar_pid, feeds=seen[0],
         arena_used=seen[1], feed_workers=seen[2])
    w = jnp.asarray(np.random.default_rng(0).standard_normal((WIDTH, WIDTH)), jnp.float32)

    @jax.jit
    def step(acc, x):
      return acc + jnp.tanh(x @ w).sum()

    acc = jnp.float32(0)
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    options = sidecar.FeedOptions(workers=int(workers))
    name, kwargs = "ids", {"n": 1 << 20, "width": WIDTH}
    if marker:
      name, kwargs = "slow_while", {**kwargs, "marker": marker}
      if os.path.exists(marker):
        os.remove(marker)
    with ctl.feed(name, kwargs=kwargs, global_batch_size=BATCH, sharding=rows,
                  options=options) as feed:
      first = next(feed)
      acc = step(acc, first["x"]).block_until_ready()  # compiled: not part of the timing
      t0 = time.perf_counter()
      ids = []
      for _ in range(int(steps)):
        batch = next(feed)
        ids.append(int(np.asarray(batch["id"])[0]))
        acc = step(acc, batch["x"])
      acc.block_until_ready()
      seconds = time.perf_counter() - t0
      emit("run", steps=int(steps), seconds=seconds, steps_per_s=int(steps) / seconds,
           first_id=int(np.asarray(first["id"])[0]), ids=ids[:4],
           feed_workers=feed_workers(sidecar_pid))
      if restart < int(fails) and marker:
        open(marker, "w").close()
        # Takes what was made before the marker, then waits in next() while the workers
        # sleep in their examples.
        threading.Thread(target=lambda: list(feed), daemon=True).start()
        time.sleep(3)
      if restart < int(fails):
        emit("kill", t=time.time(), feed_workers=feed_workers(sidecar_pid))
        os.kill(os.getpid(), signal.SIGKILL)
    emit("final", feed_workers=feed_workers(sidecar_pid))
  finally:
    ctl.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
