"""What a save's own work costs the training loop, with no sidecar: the floor under
``benchmarks.checkpoint``'s "steps/s during save".

Run from the repository root: ``python -m benchmarks.save_floor [--repeats 6]``. Not run
by CI.

After ``save()`` returns, a sidecar's work on the state is its ``O_DIRECT`` writes of the
chunk files (4 at once) and their crc32c, on idle-class (``SCHED_IDLE``) threads. Here the
same work on the same 1 GiB (8 x 128 MiB float32, page-aligned) runs in a thread beside
``benchmarks.checkpoint``'s training loop, each kind against the loop just before it, and
a buffered write+fsync at normal priority for reference. Medians (min-max) of the repeats.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import tempfile
import threading
import time

import jax

from benchmarks import checkpoint
from benchmarks.common import rate, table
from sidecar._src.ckptfmt import direct_io, records


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=6)
  ap.add_argument("--dir", default=None, help="where the files go (a disk, for O_DIRECT)")
  args = ap.parse_args()
  device = jax.devices()[0]
  state = checkpoint.make_state(device)
  arrays = checkpoint.page_aligned(state)
  train = checkpoint.Trainer(device)
  directory = tempfile.mkdtemp(prefix="sidecar-save-floor-", dir=args.dir)

  # Each runs in a thread put in the idle class first; the threads it starts inherit it.
  def direct() -> None:
    direct_io.background_thread()
    checkpoint.direct_write_seconds(arrays, directory)  # 4 at once, as the sidecar

  def crc() -> None:
    direct_io.background_thread()
    for a in arrays:
      records.shard_crc32c(a)

  def both() -> None:
    direct_io.background_thread()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      written = pool.submit(checkpoint.direct_write_seconds, arrays, directory)
      for a in arrays:
        records.shard_crc32c(a)
      written.result()

  kinds = {"O_DIRECT writes, 4 at once, SCHED_IDLE": direct,
           "crc32c, SCHED_IDLE": crc,
           "both, SCHED_IDLE (what a sidecar does)": both,
           "buffered write+fsync, normal priority (reference)":
               lambda: checkpoint.raw_write_seconds(state, directory)}
  results: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
  try:
    for r in range(args.repeats):
      print(f"repeat {r + 1} of {args.repeats}", flush=True)
      for name, work in kinds.items():
        idle = rate(train, seconds=1.5, warmup=1)[0]
        thread = threading.Thread(target=work, name="bench-save-work")
        n, t0 = 0, time.perf_counter()
        thread.start()
        while thread.is_alive():
          train()
          n += 1
        seconds = time.perf_counter() - t0
        results[name].append((seconds, n / seconds / idle))
        for f in os.listdir(directory):
          os.unlink(os.path.join(directory, f))
        os.sync()
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  rows = []
  for name, got in results.items():
    ratios = [x[1] for x in got]
    rows.append((name, f"{statistics.median(x[0] for x in got):.3f}",
                 f"{statistics.median(ratios):.0%} ({min(ratios):.0%}-{max(ratios):.0%})"))
  print(table(("work beside the loop (1 GiB)", "s", "steps/s vs no work (min-max)"), rows))


if __name__ == "__main__":
  main()
