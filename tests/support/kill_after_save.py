"""A trainer process that dies right after a save: ``python -m tests.support.kill_after_save
DIRECTORY STEP [WHEN]`` under ``sidecar.jax.initialize()``'s environment
(``launch_env.trainer_env``).

It restores the latest committed step of DIRECTORY, if any, and prints one JSON line:
whether every shard it holds is that step's own values, and the step's data position.
Then, with STEP >= 0, it saves STEP (a float32 array sharded over every process's devices,
each step's values its own, its data position ``{"position": 10 * STEP}``) and SIGKILLs
itself at once WHEN "returned" (the default: every process's ``save()`` has returned) or
"staged" (from a callback on ``handle.staged``, as it resolves, before ``save()``
returns): the step is then the sidecars' to commit, with no trainer left.
STEP -1: only the restore.
"""

import json
import os
import signal
import sys

import numpy as np

import sidecar

N = 1 << 20  # 4 MiB of float32 in all


def values(step: int) -> np.ndarray:
  return np.arange(N, dtype=np.float32) + np.float32(step * N)


def main() -> None:
  directory, step = sys.argv[1], int(sys.argv[2])
  when = sys.argv[3] if len(sys.argv) > 3 else "returned"
  sidecar.jax.initialize()
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  ctl = sidecar.jax.Controller.from_env()
  rows = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
  ckpt = ctl.checkpointer(directory, max_to_keep=None)
  latest = ckpt.latest_step()
  if latest is not None:
    restored = ckpt.restore(latest, target={
        "w": jax.ShapeDtypeStruct((N,), np.float32, sharding=rows)})["w"]
    same = all(np.array_equal(np.asarray(s.data), values(latest)[s.index])
               for s in restored.addressable_shards)
    print(json.dumps({"process": jax.process_index(), "restored": latest, "same": same,
                      "steps": ckpt.all_steps(), "data_state": ckpt.data_state(latest)}),
          flush=True)
    del restored
  if step < 0:
    ckpt.close()
    ctl.close()
    return
  state = {"w": jax.make_array_from_callback((N,), rows, lambda index: values(step)[index])}
  if when == "staged":
    import sidecar._src.controller.checkpoint.save_run as save_run  # the handle's futures
    made = save_run.SaveHandle.__init__

    def kill_at_staged(self, *args, **kwargs):
      made(self, *args, **kwargs)
      self.staged.add_done_callback(lambda _: os.kill(os.getpid(), signal.SIGKILL))
    save_run.SaveHandle.__init__ = kill_at_staged
  ckpt.save(step, state, data_state={"position": step * 10})
  try:
    ctl.peers.all_gather(f"saved/{step}", "1")  # every process's save() has returned
  finally:
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
  main()
