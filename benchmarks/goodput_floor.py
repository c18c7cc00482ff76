"""The restart floor: a SIGKILL of a process that holds the device, to a fresh process's
first step; and the device-resident loop, in that holder.

  python -m benchmarks.goodput_floor [--config tiny] [--mode fresh|standby] [--steps N]

What any restart pays, whatever feeds and checkpoints the trainer, measured the way a
restart happens (``benchmarks.goodput`` runs one round in the same run as the systems it
holds against the floor; ``benchmarks.restart_floor`` runs rounds of both modes):

  holder   a process that owns the device as a trainer does: it imports JAX, opens the
           device, puts a state of model.py's shapes and one batch there and runs the
           example's own step (``trainers.data_parallel``: the step train.py and
           train_baseline.py run, compiled from JAX's persistent cache where
           ``JAX_COMPILATION_CACHE_DIR`` holds it); with ``--steps N`` it times N more
           steps on that batch, kept on the device, each loss read as train.py reads it
           (the device-resident loop the feed and the saves are held against); then it
           steps on until it is SIGKILLed
  fresh    spawned once the killed holder is reaped (what a launcher does): it imports
           JAX, opens the device (retried while the runtime refuses it: the killed
           process not yet gone), puts the state (zeros from host memory: the bytes a
           restore finds there, with no time spent making them) and runs the step
  standby  the same, but spawned before the kill: JAX and ``--preload``'s modules
           imported, it waits on its stdin and is told to go once the holder is reaped

The floor is the kill to the next process's first loss; its parts are seconds from the
kill: the holder reaped (its teardown: the device is free only then), the next process's
Python running, its imports done, the device open, the state put, the first step.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASES = ("reaped", "python", "imports", "devices", "state", "first step")


def device_state(config_name: str, *, fill: str = "random"):
  """model.py's state and one batch of ``config_name`` on every device (ready), and the
  example's step (``trainers.data_parallel``, as the trainers build it). Put from numpy,
  not init_state: its jit would add a compile of its own. ``fill``: ``"random"`` (as
  init's: all-zero parameters drive the moments into denormals, slow on CPU over many
  steps) or ``"zeros"`` (no time spent making them: one step's time is the same)."""
  import jax
  import numpy as np
  sys.path.insert(0, str(ROOT / "examples" / "lm"))
  import model
  import trainers
  config = model.CONFIGS[config_name]
  optimizer, train_step, replicated, rows = trainers.data_parallel(config)
  rng = np.random.default_rng(0)
  shapes = model.abstract_state(config, optimizer)
  make = ((lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype))
          if fill == "random" else (lambda s: np.zeros(s.shape, s.dtype)))
  host = {"step": np.zeros((), np.int32), "params": jax.tree.map(make, shapes["params"]),
          "opt": jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes["opt"])}
  state = jax.device_put(host, replicated)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size,
                                             (config.batch_size, config.seq_len + 1))
  batch = jax.device_put({"tokens": tokens.astype(np.int32)}, rows)
  jax.block_until_ready((state, batch))
  return state, batch, train_step


def open_devices() -> tuple[list, int]:
  """The devices, opened, retrying while the runtime refuses them; and the tries."""
  import jax
  from jax.extend import backend
  for tries in range(1, 200):
    try:
      return jax.devices(), tries
    except RuntimeError as e:  # libtpu's lockfile: the killed process not yet gone
      if tries == 1:
        print(f"device refused once: {str(e)[:200]}", file=sys.stderr, flush=True)
      backend.clear_backends()  # a partial init (the CPU's) would be kept otherwise
      time.sleep(0.05)
  raise RuntimeError("the device was refused 200 times")


def resident_rate(state, batch, train_step, steps: int) -> tuple[float, object]:
  """Steps/s of ``steps`` steps on ``batch``, each loss read after the next is queued;
  and the state after them (the step donates its input)."""
  pending = None
  t0 = time.perf_counter()
  for _ in range(steps):
    state, loss = train_step(state, batch)
    if pending is not None:
      float(pending.addressable_data(0))
    pending = loss
  float(pending.addressable_data(0))
  return steps / (time.perf_counter() - t0), state


def child(mode: str, config: str, preload: list[str], steps: int) -> None:
  """A holder (times ``steps`` resident steps, then steps until killed) or a next
  process (fresh, or standby: waits for a line on stdin after its imports). Prints its
  marks as one JSON line."""
  marks = {"python": time.time()}
  import importlib

  import jax  # noqa: F401 - the import is what this phase times
  for name in preload:
    importlib.import_module(name)
  marks["imports"] = time.time()
  if mode == "standby":
    print("IMPORTED", flush=True)
    sys.stdin.readline()
    marks["go"] = time.time()
  devices, tries = open_devices()
  marks["devices"] = time.time()
  state, batch, step = device_state(config, fill="random" if mode == "holder" else "zeros")
  marks["state"] = time.time()
  state, loss = step(state, batch)
  float(loss.addressable_data(0))
  marks["first step"] = time.time()
  out = {"marks": marks, "device_tries": tries, "platform": devices[0].platform}
  if mode != "holder":
    print(json.dumps(out), flush=True)
    return
  if steps:
    rate, state = resident_rate(state, batch, step, steps)
    out.update(resident_steps=steps, resident_steps_per_s=rate)
  print(json.dumps(out), flush=True)
  print("READY", flush=True)
  while True:  # a trainer's steps, until the SIGKILL
    state, loss = step(state, batch)
    float(loss.addressable_data(0))


def _spawn(mode: str, config: str, env: dict, *, preload: list[str],
           steps: int = 0) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "benchmarks.goodput_floor", "--child", mode, "--config", config,
       "--steps", str(steps), *(x for m in preload for x in ("--preload", m))],
      cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _line(proc: subprocess.Popen, name: str, what: str) -> str:
  """The next line ``proc`` (the ``name`` process) prints, which should be ``what``."""
  assert proc.stdout is not None
  line = proc.stdout.readline()
  if not line:
    raise RuntimeError(f"the {name} process ended (exit {proc.wait()}) before {what}")
  return line.strip()


def one_round(mode: str, config: str, env: dict, *, preload: Sequence[str] = (),
              resident_steps: int = 0, settle: float = 1.0) -> dict:
  """A holder SIGKILLed, then a ``mode`` process to its first step: seconds from the
  kill by phase (:data:`PHASES`), ``first_step_s`` (the floor) and the holder's
  resident steps/s."""
  holder = _spawn("holder", config, env, preload=[], steps=resident_steps)
  nxt = None
  try:
    held = json.loads(_line(holder, "holder", "its first step"))
    if (word := _line(holder, "holder", "READY")) != "READY":
      raise RuntimeError(f"expected READY from the holder, got {word!r}")
    if mode == "standby":
      nxt = _spawn("standby", config, env, preload=list(preload))
      if (word := _line(nxt, "standby", "IMPORTED")) != "IMPORTED":
        raise RuntimeError(f"expected IMPORTED from the standby, got {word!r}")
    time.sleep(settle)
    killed = time.time()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    reaped = time.time()
    if nxt is None:
      nxt = _spawn("fresh", config, env, preload=list(preload))
    else:
      assert nxt.stdin is not None
      nxt.stdin.write("go\n")
      nxt.stdin.flush()
    out, _ = nxt.communicate(timeout=600)
  finally:  # whatever failed: nothing of ours left running
    for proc in (holder, nxt):
      if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
  assert nxt is not None
  if nxt.returncode:
    raise RuntimeError(f"the {mode} process failed ({nxt.returncode})")
  result = json.loads(out.strip().splitlines()[-1])
  row = {"reaped": reaped - killed}
  for name in PHASES[1:]:
    row[name] = max(result["marks"][name], reaped) - killed  # a standby's imports: before
  return {"mode": mode, "first_step_s": row["first step"], "from_kill_s": row,
          "device_tries": result["device_tries"], "platform": result["platform"],
          "resident_steps": held.get("resident_steps", 0),
          "resident_steps_per_s": held.get("resident_steps_per_s", 0.0),
          "holder_start_s": {k: v - held["marks"]["python"]
                             for k, v in held["marks"].items()}}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="tiny")
  p.add_argument("--mode", default="fresh", choices=("fresh", "standby"))
  p.add_argument("--steps", type=int, default=0, help="the holder's device-resident steps")
  p.add_argument("--preload", action="append", default=[],
                 help="modules the next process imports before the device (default: JAX)")
  p.add_argument("--child", choices=("holder", "fresh", "standby"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    child(args.child, args.config, args.preload, args.steps)
    return 0
  with tempfile.TemporaryDirectory(prefix="goodput-floor-cache-") as cache:
    env = {"JAX_COMPILATION_CACHE_DIR": cache, **os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])}
    print(json.dumps(one_round(args.mode, args.config, env, preload=args.preload,
                               resident_steps=args.steps)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
