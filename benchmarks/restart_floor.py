"""What a trainer's restart pays between a SIGKILL and its first step, part by part.

  python -m benchmarks.restart_floor [--config chip] [--rounds 2] [--preload MOD ...]

From the repository root; not run by CI. Rounds of ``goodput_floor.one_round``, the
floor ``benchmarks.goodput`` measures in each of its runs: a "holder" process owns the
device as a trainer does (model.py's state put there, the example's step compiled,
stepping), and is SIGKILLed. Then, alternating round by round, the next process is either

  fresh     spawned once the killed one is reaped (what a launcher does today), or
  standby   spawned before the kill: it has imported JAX (and ``--preload``'s modules)
            and waits on its stdin; once the killed one is reaped it is told to go

and each opens the device (retried while the runtime still refuses it), puts the state
(zeros from host memory) and runs the step (from JAX's persistent compilation cache,
which the holder filled). Rows, seconds from the kill: the killed process reaped; the
next one's Python running, its imports done, the device open, the state put, the first
step's loss. The difference between the columns is what a standby process saves each
restart. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

from benchmarks import goodput_floor

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODES = ("fresh", "standby")


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="chip")
  p.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternating")
  p.add_argument("--preload", action="append", default=[],
                 help="modules the next process imports before the device (default: jax "
                      "only; model.py's optax is the trainer's next import)")
  p.add_argument("--settle", type=float, default=1.0,
                 help="seconds the holder steps before the kill")
  args = p.parse_args(argv)
  results = []
  with tempfile.TemporaryDirectory(prefix="restart-floor-cache-") as cache:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(
               [str(ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                              if x])}
    for i in range(2 * args.rounds):
      mode = MODES[i % 2]
      r = goodput_floor.one_round(mode, args.config, env, preload=args.preload,
                                  settle=args.settle)
      print(f"round {i}: {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                 r["from_kill_s"].items())
            + f" (device tries {r['device_tries']})", flush=True)
      results.append(r)
  print()
  print(f"{'seconds from the kill':<22}" + "".join(f"{m:>10}" for m in MODES))
  for name in goodput_floor.PHASES:
    cells = []
    for mode in MODES:
      vals = [r["from_kill_s"][name] for r in results if r["mode"] == mode]
      cells.append(f"{statistics.median(vals):10.2f}")
    print(f"{name:<22}" + "".join(cells))
  print(json.dumps({"config": args.config, "preload": args.preload, "rounds": results}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
