"""A trainer that saves one step, then waits to be stopped: for ``sidecar launch``'s stop.

Run as ``sidecar launch --hosts 1 -- python -m tests.support.save_trainer DIR [RELEASE]``:
it saves step 1 of a small array into checkpoint directory DIR, prints ``saved pid=PID``,
then waits until the file RELEASE exists (and exits 0), or for ever without one: the
launcher stops it.
"""

import os
import sys
import time

import numpy as np

import sidecar


def main(directory: str, release: str | None) -> None:
  with sidecar.jax.Controller.from_env(timeout=60) as ctl:
    ckpt = ctl.checkpointer(directory)
    ckpt.save(1, {"w": np.arange(1000, dtype=np.float32)})
    print(f"saved pid={os.getpid()}", flush=True)
    while release is None or not os.path.exists(release):
      time.sleep(0.05)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
