"""A trainer for the goodput ledger's tests: a feed, a checkpointer, nothing else.

``python -m tests.support.goodput_train ADDRESS CKPT_DIR STEPS STEP_S [--hang-after K]``:
a JAX Controller of the sidecar at ADDRESS; restores the latest step of CKPT_DIR if
there is one, then takes one batch per step (each step sleeps STEP_S: its "compute"),
saves every SAVE_EVERY steps (each waited for until durable), and prints
``RESULT {...}`` lines (JSON). With ``--hang-after K`` it stops stepping once step K
is done (saved or not) and waits to be killed, having said so (``{"kind": "hanging"}``).
"""

import json
import sys
import time

SAVE_EVERY = 5


def main(address: str, directory: str, steps: int, step_s: float, hang_after: int | None
         ) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  import sidecar

  def emit(kind, **fields):
    print("RESULT " + json.dumps({"kind": kind, **fields}), flush=True)

  device = jax.devices()[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  with sidecar.jax.Controller([address]) as ctl:
    ckpt = ctl.checkpointer(directory, max_to_keep=2)
    state = {"w": jnp.zeros((4,), jnp.float32), "step": np.int32(0)}
    first, data_state = 0, None
    if ckpt.latest_step() is not None:
      state = ckpt.restore(target=state)
      first = int(state["step"])
      data_state = ckpt.data_state()
      emit("restored", step=first)
    with ctl.feed("ids", kwargs={"n": 1 << 20}, global_batch_size=4, sharding=sharding,
                  state=data_state) as feed:
      for step in range(first + 1, steps + 1):
        batch = next(feed)
        time.sleep(step_s)
        state = {"w": state["w"] + batch["x"].sum(), "step": np.int32(step)}
        if step % SAVE_EVERY == 0:
          ckpt.save(step, state, data_state=feed.state()).durable.result()
          emit("saved", step=step)
        emit("step", step=step)
        if hang_after is not None and step >= hang_after:
          emit("hanging", step=step)
          time.sleep(3600)
    ckpt.wait()
  emit("done", steps=steps)
  return 0


if __name__ == "__main__":
  args = sys.argv[1:]
  hang = None
  if "--hang-after" in args:
    i = args.index("--hang-after")
    hang = int(args[i + 1])
    del args[i:i + 2]
  sys.exit(main(args[0], args[1], int(args[2]), float(args[3]), hang))
