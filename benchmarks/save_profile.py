"""Where a save's cost to training goes: the LM's step times around each save, by phase.

Run from the repository root::

  python -m benchmarks.save_profile --config chip --data DATA_DIR   # on the v5e: ~3 minutes
  python -m benchmarks.save_profile --quick                         # tiny, on CPU: ~1 minute

One process trains ``examples/lm``'s model beside a 1-host ``LocalCluster`` (its sidecar's
processes on the CPU), in rounds of ``--steps`` steps each:

- ``resident``: one batch kept on the device, no saves (the loop every ratio is held to);
- ``resident+d2h``: the same, and every ``--every`` steps the state's device-to-host copy
  that plain JAX makes (``copy_to_host_async`` on every leaf, then ``np.asarray`` in a
  thread, dropped): what the copy alone costs the steps;
- ``resident+save``: the same, and every ``--every`` steps ``ckpt.save`` through the
  sidecar (its copy, the stager, the arena, the sidecar's write);
- ``feed`` and ``feed+save``: batches from ``ctl.feed``, without and with the saves
  (``train.py``'s loop).

Each step's time is read as ``train.py`` reads its loss (after the next step is queued).
Each save's moments are kept: the call, its return, ``staged`` (the state in the arena)
and ``durable`` (committed on storage). A step whose interval overlaps a save's call to
``staged`` counts as ``copy``, else one overlapping ``staged`` to ``durable`` as
``write``, else ``quiet``. Per mode: the mean step, the mean step of each class, and the
time lost per save (the sum over steps of (step - the same rounds' no-save median),
divided by the saves), split into the classes. The first saves of each mode (a state's
first save compiles its split) are taken before timing starts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import sidecar
from benchmarks.common import table

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))

MODES = ("resident", "resident+d2h", "resident+save", "feed", "feed+save")


def d2h_copy(state, moments: dict):
  """Plain JAX's device-to-host copy of ``state``, as an async saver starts it: a copy on
  the device (the step donates the state), every leaf's ``copy_to_host_async``, then a
  thread that waits for each (``np.asarray``) and sets ``moments["staged"]`` when all
  have landed. Returns the thread (joined before the next)."""
  import jax
  leaves = jax.tree.leaves(_device_copy(state))
  for leaf in leaves:
    leaf.copy_to_host_async()

  def wait():
    for leaf in leaves:
      np.asarray(leaf)
    moments["staged"] = time.perf_counter()

  t = threading.Thread(target=wait, daemon=True)
  t.start()
  return t


_COPY = None


def _device_copy(state):
  global _COPY
  if _COPY is None:
    import jax
    import jax.numpy as jnp
    _COPY = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
  return _COPY(state)


class GcLog:
  """Each garbage collection of this process: (generation, start, end) in perf_counter
  seconds, from ``gc.callbacks``."""

  def __init__(self):
    self.collections: list[tuple[int, float, float]] = []
    self._start = 0.0
    gc.callbacks.append(self._on)

  def _on(self, phase: str, info: dict) -> None:
    if phase == "start":
      self._start = time.perf_counter()
    else:
      self.collections.append((info["generation"], self._start, time.perf_counter()))

  def between(self, a: float, b: float) -> list[tuple[int, float, float]]:
    return [c for c in self.collections if a <= c[1] < b]


def run_mode(mode: str, *, ctl, ckpt_dir: str, config, state, batch, train_step, steps: int,
             every: int, warm_saves: int, feed_kwargs: dict, seed: int) -> dict:
  """Steps of one mode: their end times, and the saves' moments (perf_counter seconds)."""
  saves: list[dict] = []
  ends: list[float] = []
  ckpt = ctl.checkpointer(ckpt_dir, max_to_keep=2) if mode.endswith("+save") else None
  feed = (ctl.feed("lm", global_batch_size=config.batch_size, sharding=batch["tokens"].sharding,
                   seed=seed, kwargs=feed_kwargs) if mode.startswith("feed") else None)
  copier = None
  try:
    warm = warm_saves * every if (ckpt or mode.endswith("d2h")) else every
    pending = None
    for i in range(1, warm + steps + 1):
      b = next(feed) if feed is not None else batch
      state, loss = train_step(state, b)
      if pending is not None:
        float(pending.addressable_data(0))
        if i > warm + 1:
          ends.append(time.perf_counter())
      pending = loss
      if i == warm:
        float(loss.addressable_data(0))
        pending = None
        if ckpt is not None:
          ckpt.wait()  # the warm-up saves done before timing starts
        if copier is not None:
          copier.join()
        ends.append(time.perf_counter())
      if i % every == 0:
        if ckpt is not None:
          moments = {"step": i, "call": time.perf_counter()}
          handle = ckpt.save(i, state, data_state=feed.state() if feed is not None else None)
          moments["return"] = time.perf_counter()
          for name in ("staged", "durable"):
            getattr(handle, name).add_done_callback(
                lambda _f, name=name, m=moments: m.__setitem__(name, time.perf_counter()))
          if i > warm:
            saves.append(moments)
        elif mode.endswith("d2h"):
          if copier is not None:
            copier.join()
          moments = {"step": i, "call": time.perf_counter()}
          copier = d2h_copy(state, moments)
          moments["return"] = time.perf_counter()
          if i > warm:
            saves.append(moments)
    float(pending.addressable_data(0))
    ends.append(time.perf_counter())
    if copier is not None:
      copier.join()
    if ckpt is not None:
      ckpt.wait()
  finally:
    if feed is not None:
      feed.close()
    if ckpt is not None:
      ckpt.close()
  return {"ends": ends, "saves": saves, "state": state}


_WROTE = re.compile(r"step \d+: wrote .* in ([0-9.]+) s")


def sidecar_drop_ram(ctl, directory: str) -> None:
  """Lets the sidecar's RAM tier drop ``directory``'s steps (a closed checkpointer's last
  step stays in the arena otherwise, ram_steps=1)."""
  try:
    ctl.checkpointer(directory, ram_steps=0).close()  # reopened with ram_steps=0: freed
  except Exception as e:  # noqa: BLE001 (a benchmark's tidying)
    print(f"(RAM tier of {directory} kept: {e})", flush=True)


def classify(ends: list[float], saves: list[dict]) -> list[str]:
  """Each step interval's class: copy, write or quiet (see the module's docstring)."""
  out = []
  for a, b in zip(ends, ends[1:]):
    cls = "quiet"
    for s in saves:
      staged = s.get("staged", s["return"])
      if a < staged and b > s["call"]:
        cls = "copy"
        break
      if "durable" in s and a < s["durable"] and b > staged:
        cls = "write"
    out.append(cls)
  return out


def summarise(mode: str, run: dict, base_step: float) -> dict:
  ends, saves = run["ends"], run["saves"]
  dts = np.diff(ends)
  classes = classify(ends, saves)
  row = {"mode": mode, "steps": len(dts), "saves": len(saves),
         "mean_step_ms": 1e3 * float(dts.mean()), "median_step_ms": 1e3 * float(np.median(dts)),
         "steps_per_s": len(dts) / (ends[-1] - ends[0])}
  for cls in ("copy", "write", "quiet"):
    sel = np.array([c == cls for c in classes])
    row[f"{cls}_steps"] = int(sel.sum())
    row[f"{cls}_mean_ms"] = 1e3 * float(dts[sel].mean()) if sel.any() else None
    row[f"{cls}_lost_ms_per_save"] = (1e3 * float((dts[sel] - base_step).sum()) / len(saves)
                                      if saves and sel.any() else None)
  row["raw"] = {"step_ms": [round(1e3 * float(d), 3) for d in dts], "class": classes,
                "write_s": run.get("write_s", []),
                "saves_ms": [{k: round(1e3 * (v - ends[0]), 3) for k, v in s.items() if k != "step"}
                             for s in saves]}
  collections = run.get("gc", [])
  row["raw"]["gc_ms"] = [(g, round(1e3 * (a - ends[0]), 3), round(1e3 * (b - a), 3))
                         for g, a, b in collections]
  for g in (1, 2):
    row[f"gc{g}_n"] = sum(1 for c in collections if c[0] == g)
    row[f"gc{g}_ms"] = 1e3 * sum(b - a for c_g, a, b in collections if c_g == g)
  if saves:
    row["lost_ms_per_save"] = 1e3 * float((dts - base_step).sum()) / len(saves)
    row["call_ms"] = 1e3 * statistics.median(s["return"] - s["call"] for s in saves)
    if all("staged" in s for s in saves):
      row["staged_ms"] = 1e3 * statistics.median(s["staged"] - s["call"] for s in saves)
    if all("durable" in s for s in saves):
      row["durable_ms"] = 1e3 * statistics.median(s["durable"] - s["call"] for s in saves)
  return row


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny config, short rounds, on CPU")
  parser.add_argument("--config", default=None, help="tiny or chip (default: chip; --quick tiny)")
  parser.add_argument("--data", default=None, help="a corpus of examples/lm/prepare.py "
                      "(default: prepare 2 MiB here)")
  parser.add_argument("--steps", type=int, default=None, help="timed steps a mode and round")
  parser.add_argument("--every", type=int, default=20, help="steps between saves")
  parser.add_argument("--rounds", type=int, default=None, help="rounds of every mode, "
                      "interleaved (default: 2; --quick 1)")
  parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: "
                      + ", ".join(MODES))
  parser.add_argument("--shm-size", default=None, help="the sidecar's arena (default: 12GiB "
                      "chip, 512MiB tiny)")
  parser.add_argument("--settle", type=float, default=10.0, help="seconds of rest after a "
                      "saving mode, its directory deleted, before the next (default: 10)")
  parser.add_argument("--out", default=None, help="directory for save-profile-<time>.json")
  args = parser.parse_args(argv)
  config_name = args.config or ("tiny" if args.quick else "chip")
  steps = args.steps or (100 if args.quick else 200)
  rounds = args.rounds or (1 if args.quick else 2)
  modes = [m for m in args.modes.split(",") if m]
  if bad := [m for m in modes if m not in MODES]:
    parser.error(f"unknown mode(s) {bad}: choose from {', '.join(MODES)}")
  import jax
  import model

  from benchmarks.goodput_floor import device_state
  base = tempfile.mkdtemp(prefix="save-profile-")
  data = args.data
  try:
    if data is None:
      data = os.path.join(base, "data")
      subprocess.run([sys.executable, str(ROOT / "examples" / "lm" / "prepare.py"), "--out",
                      data, "--max-mb", "2"], check=True)
    config = model.CONFIGS[config_name]
    state, batch, train_step = device_state(config_name, jax.devices())
    shm_size = args.shm_size or ("12GiB" if config_name == "chip" else "512MiB")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    t0 = time.time()
    gc_log = GcLog()
    log_seen = 0
    with sidecar.testing.LocalCluster(
        num_hosts=1, devices_per_host=1, shm_size=shm_size, imports=["pipelines.lm"],
        checkpoint_roots=[base], start_timeout=180) as cluster, cluster.controller() as ctl:
      for r in range(rounds):
        for mode in modes:
          run = run_mode(mode, ctl=ctl, ckpt_dir=os.path.join(base, f"ckpt-{mode}-{r}"),
                         config=config, state=state, batch=batch, train_step=train_step,
                         steps=steps, every=args.every, warm_saves=2,
                         feed_kwargs={"data": os.path.abspath(data),
                                      "seq_len": config.seq_len}, seed=r)
          state = run.pop("state")
          run["gc"] = gc_log.between(run["ends"][0], run["ends"][-1])
          # The sidecar's own write time of each save (its log's "step N: wrote ... in S s"):
          # a slow durable shows as the storage's, not the mode's. Then the mode's directory
          # goes (its steps would stay on /tmp for the rest of the run, and its RAM-tier
          # step in the arena) and the storage gets --settle s to catch up, so the next mode
          # does not start behind the previous one's writes.
          log_text = cluster.log(0)
          run["write_s"] = [float(m.group(1)) for m in _WROTE.finditer(log_text[log_seen:])]
          log_seen = len(log_text)
          ckpt_dir = os.path.join(base, f"ckpt-{mode}-{r}")
          if os.path.isdir(ckpt_dir):
            sidecar_drop_ram(ctl, ckpt_dir)
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            time.sleep(args.settle)
          results[mode].append(run)
          print(f"round {r} {mode}: {len(run['ends']) - 1} steps, {len(run['saves'])} saves "
                f"({time.time() - t0:.0f} s)", flush=True)
    rows = []
    base_of = {"resident": "resident", "resident+d2h": "resident", "resident+save": "resident",
               "feed": "feed", "feed+save": "feed"}
    for mode in modes:
      summaries = []
      ref = next(m for m in (base_of[mode], "resident", mode) if m in results)
      base_step = statistics.median(float(np.median(np.diff(run["ends"])))
                                    for run in results[ref])
      for run in results[mode]:
        summaries.append(summarise(mode, run, base_step))
      row = {k: (statistics.mean(s[k] for s in summaries)
                 if isinstance(summaries[0][k], float) and all(s[k] is not None for s in summaries)
                 else summaries[0][k]) for k in summaries[0]}
      row["base_step_ms"] = 1e3 * base_step
      row["rounds"] = summaries
      row.pop("raw")
      rows.append(row)
  finally:
    shutil.rmtree(base, ignore_errors=True)
  platform = jax.devices()[0].platform
  ref_rate = next((r["steps_per_s"] for r in rows if r["mode"] == "resident"), None)

  def ms(v):
    return "-" if v is None else f"{v:.1f}"

  print(f"\n{config_name} on {platform}: {steps} steps a mode and round, {rounds} round(s), "
        f"a save every {args.every} steps\n")
  if rounds > 1:
    rows = rows + [dict(s, mode=f"{s['mode']} (round {i})") for r in rows
                   for i, s in enumerate(r["rounds"])]
  print(table(
      ["mode", "steps/s", "x resident", "mean step ms", "copy: n, ms", "write: n, ms",
       "quiet: n, ms", "lost/save ms (copy + write + quiet)", "save() ms", "staged ms",
       "durable ms", "gc gen 1/2: n, ms"],
      [[r["mode"], f"{r['steps_per_s']:.3f}",
        "-" if ref_rate is None else f"{r['steps_per_s'] / ref_rate:.4f}",
        ms(r["mean_step_ms"]),
        f"{r['copy_steps']}, {ms(r['copy_mean_ms'])}",
        f"{r['write_steps']}, {ms(r['write_mean_ms'])}",
        f"{r['quiet_steps']}, {ms(r['quiet_mean_ms'])}",
        ("-" if "lost_ms_per_save" not in r else
         f"{r['lost_ms_per_save']:.1f} ({ms(r['copy_lost_ms_per_save'])} + "
         f"{ms(r['write_lost_ms_per_save'])} + {ms(r['quiet_lost_ms_per_save'])})"),
        ms(r.get("call_ms")), ms(r.get("staged_ms")), ms(r.get("durable_ms")),
        f"{r['gc1_n']:.0f}, {r['gc1_ms']:.0f} / {r['gc2_n']:.0f}, {r['gc2_ms']:.0f}"]
       for r in rows]))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"save-profile-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
      json.dump({"config": config_name, "platform": platform, "steps": steps, "rounds": rounds,
                 "every": args.every, "rows": rows}, f, indent=1)
    print(f"\nwritten: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
