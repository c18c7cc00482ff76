"""What a trainer's restart pays between a SIGKILL and its first step, part by part.

  python -m benchmarks.restart_floor [--config chip] [--rounds 2] [--preload MOD ...]

From the repository root; not run by CI. A "holder" process owns the device as a trainer
does (model.py's state put there, its step compiled, stepping), and is SIGKILLed. Then,
alternating round by round, the next process is either

  fresh     spawned once the killed one is reaped (what a launcher does today), or
  standby   spawned before the kill: it has imported JAX (and ``--preload``'s modules)
            and waits on its stdin; once the killed one is reaped it is told to go

and each opens the device (retried while the runtime still refuses it), puts the state
and runs the step (from JAX's persistent compilation cache, which the holder filled).
Rows, seconds from the kill: the killed process reaped; the next one's Python running,
its imports done, the device open, the state put, the first step's loss. The difference
between the rows is what a standby process saves each restart.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import goodput_floor

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASES = ("reaped", "python", "imports", "devices", "state", "first step")


def _open_devices() -> int:
  """Opens the device, retrying while the runtime refuses it; returns the tries."""
  import jax
  from jax.extend import backend
  for tries in range(1, 200):
    try:
      jax.devices()
      return tries
    except RuntimeError as e:  # libtpu's lockfile: the killed process not yet gone
      if tries == 1:
        print(f"device refused once: {str(e)[:200]}", file=sys.stderr, flush=True)
      backend.clear_backends()  # a partial init (the CPU's) would be kept otherwise
      time.sleep(0.05)
  raise RuntimeError("the device was refused 200 times")


def child(mode: str, config: str, preload: list[str]) -> None:
  """A holder (steps until killed) or a next process (fresh, or standby: waits for a
  line on stdin after its imports). Prints its marks as one JSON line."""
  marks = {"python": time.time()}
  import importlib

  import jax
  for name in preload:
    importlib.import_module(name)
  marks["imports"] = time.time()
  if mode == "standby":
    print("IMPORTED", flush=True)
    sys.stdin.readline()
    marks["go"] = time.time()
  tries = _open_devices()
  marks["devices"] = time.time()
  state, batch, step = goodput_floor.device_state(config, jax.devices())
  marks["state"] = time.time()
  state, loss = step(state, batch)
  float(loss.addressable_data(0))
  marks["first step"] = time.time()
  if mode != "holder":
    print(json.dumps({"marks": marks, "device_tries": tries}), flush=True)
    return
  print("READY", flush=True)
  while True:  # a trainer's steps, until the SIGKILL
    state, loss = step(state, batch)
    float(loss.addressable_data(0))


def _spawn(mode: str, args, env: dict) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "benchmarks.restart_floor", "--child", mode, "--config",
       args.config, *(x for m in args.preload for x in ("--preload", m))],
      cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _expect(proc: subprocess.Popen, word: str) -> None:
  line = proc.stdout.readline()
  if line.strip() != word:
    raise RuntimeError(f"expected {word} from the {proc.args[4]} process, got {line!r} "
                       f"(exit {proc.poll()})")


def one_round(mode: str, args, env: dict) -> dict:
  holder = _spawn("holder", args, env)
  _expect(holder, "READY")
  standby = None
  if mode == "standby":
    standby = _spawn("standby", args, env)
    _expect(standby, "IMPORTED")  # imported while the holder owns the device
  time.sleep(args.settle)
  killed = time.time()
  os.kill(holder.pid, signal.SIGKILL)
  holder.wait()
  reaped = time.time()
  if standby is None:
    nxt = _spawn("fresh", args, env)
  else:
    nxt = standby
    nxt.stdin.write("go\n")
    nxt.stdin.flush()
  out, _ = nxt.communicate(timeout=300)
  if nxt.returncode:
    raise RuntimeError(f"the {mode} process failed ({nxt.returncode})")
  result = json.loads(out.strip().splitlines()[-1])
  marks = result["marks"]
  row = {"reaped": reaped - killed}
  for name in PHASES[1:]:
    row[name] = max(marks[name], reaped) - killed  # a standby's imports were before
  return {"mode": mode, "from_kill_s": row, "device_tries": result["device_tries"]}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="chip")
  p.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternating")
  p.add_argument("--preload", action="append", default=[],
                 help="modules the next process imports before the device (default: jax "
                      "only; model.py's optax is the trainer's next import)")
  p.add_argument("--settle", type=float, default=1.0,
                 help="seconds the holder steps before the kill")
  p.add_argument("--child", choices=("holder", "fresh", "standby"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    child(args.child, args.config, args.preload)
    return 0
  cache = tempfile.mkdtemp(prefix="restart-floor-cache-")
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache,
         "PYTHONPATH": os.pathsep.join(
             [str(ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])}
  results = []
  for i in range(2 * args.rounds):
    mode = ("fresh", "standby")[i % 2]
    r = one_round(mode, args, env)
    print(f"round {i}: {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                               r["from_kill_s"].items())
          + f" (device tries {r['device_tries']})", flush=True)
    results.append(r)
  print()
  print(f"{'seconds from the kill':<22}" + "".join(f"{m:>10}" for m in ("fresh", "standby")))
  for name in PHASES:
    cells = []
    for mode in ("fresh", "standby"):
      vals = [r["from_kill_s"][name] for r in results if r["mode"] == mode]
      cells.append(f"{statistics.median(vals):10.2f}")
    print(f"{name:<22}" + "".join(cells))
  print(json.dumps({"config": args.config, "preload": args.preload, "rounds": results}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
