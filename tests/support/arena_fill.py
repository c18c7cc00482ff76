"""A trainer rank that takes 1 MiB arena blocks until its sidecar refuses (`python -m
tests.support.arena_fill FLAG`): rank 0 first, then rank 1, each holding what it got until
both are done; prints ``rank R held N MiB``. Ranks that share a sidecar show their shares."""

import os
import sys
import time

import numpy as np

import sidecar


def main(flag: str) -> None:
  rank = int(os.environ["SIDECAR_PROCESS_ID"])
  if rank == 1:
    while not os.path.exists(flag + ".0"):
      time.sleep(0.05)
  with sidecar.jax.Worker() as w:
    held = []
    try:
      while len(held) < 64:
        held.append(w.empty((1 << 20,), np.uint8)[0])
    except sidecar.ResourceExhaustedError:
      pass
    print(f"rank {rank} held {len(held)} MiB", flush=True)
    open(f"{flag}.{rank}", "w").close()
    while not os.path.exists(flag + ".1"):
      time.sleep(0.05)
    del held


if __name__ == "__main__":
  main(sys.argv[1])
