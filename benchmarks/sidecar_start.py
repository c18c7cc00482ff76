"""What a sidecar costs to start: seconds until ``--ready-file`` is written, and its RSS then.

``python -m benchmarks.sidecar_start [--rounds N]``: ``sidecar serve`` started N times per
row, rows taking turns round by round (so load on the machine falls on all alike), each
stopped with SIGTERM once ready. Rows:

- a module that registers one framework-free function (a lean sidecar: nothing but the
  sidecar's own start);
- the same module with ``import jax`` at its top (a sidecar whose registered code needs JAX:
  what every sidecar paid while the sidecar's own modules imported it at start);
- the same with ``import grain`` (Grain brings JAX, Orbax and TensorStore);
- a PyTorch job's sidecar: the framework-free module with a plain-iterable pipeline, started
  and then read one batch by ``sidecar.torch.DataLoader`` (from this process): seconds to
  ready plus the first batch, RSS after it, and the frameworks it loaded by then (a feed
  imported jax.tree_util before core/trees.py; needs torch, else the row is left out);
- the interpreter alone, and ``import jax`` alone, for scale.

Prints medians (min-max) and each row against the lean one, with the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import table

LEAN = "import sidecar\n\n@sidecar.function\ndef hello(x: int) -> int:\n  return x + 1\n"
FEED = LEAN + """
import sys
import numpy as np

@sidecar.function
def loaded() -> list[str]:
  return [m for m in ("jax", "jaxlib", "orbax", "tensorstore", "grain") if m in sys.modules]

@sidecar.pipeline
def rows(ctx: sidecar.PipelineContext, n: int = 256):
  for i in range(ctx.shard_index, n, ctx.shard_count)[ctx.position:]:
    yield {"x": np.full((1024,), i, np.float32), "y": (np.int64(i), [None, np.int32(-i)])}
"""
TORCH_FEED = "sidecar serve + first sidecar.torch feed batch"
ROWS = {
    "sidecar serve, framework-free module": ("serve", LEAN),
    "sidecar serve, module imports jax": ("serve", "import jax\n" + LEAN),
    "sidecar serve, module imports grain": ("serve", "import grain\n" + LEAN),
    TORCH_FEED: ("feed", FEED),
    "python -c pass (interpreter)": ("python", "pass"),
    "python -c 'import jax'": ("python", "import jax"),
}
_FRAMEWORKS = ("jax", "jaxlib", "orbax", "tensorstore", "grain")


def _rss_mib(pid: int) -> float:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  raise RuntimeError(f"no VmRSS for {pid}")


def _serve(work: pathlib.Path, module: str, n: int, *, feed: bool = False
           ) -> tuple[float, float, list[str] | None]:
  """Seconds to ready (and, with ``feed``, to a first batch) and RSS then; with ``feed``
  the frameworks the sidecar had loaded by then."""
  ready = work / f"ready-{n}.json"
  args = [sys.executable, "-m", "sidecar", "serve", "--import", module, "--port", "0",
          "--health-port", "0", "--socket", str(work / f"s{n}.sock"), "--shm-size", "64MiB",
          "--ready-file", str(ready)]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      [str(work), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  t0 = time.perf_counter()
  p = subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
  try:
    while not ready.exists():
      if p.poll() is not None:
        raise RuntimeError(f"sidecar serve exited {p.returncode}: "
                           f"{p.stderr.read().decode()[-2000:] if p.stderr else ''}")
      time.sleep(0.002)
    loaded = None
    if feed:
      loaded = _first_batch(json.loads(ready.read_text())["port"])
    seconds = time.perf_counter() - t0
    return seconds, _rss_mib(p.pid), loaded
  finally:
    p.send_signal(signal.SIGTERM)
    try:
      p.wait(30)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def _first_batch(port: int) -> list[str]:
  """One batch of the ``rows`` pipeline through ``sidecar.torch.DataLoader``; the
  frameworks the sidecar has loaded then."""
  import sidecar.torch
  with sidecar.torch.Controller([f"127.0.0.1:{port}"]) as ctl:
    with sidecar.torch.DataLoader("rows", 32, controller=ctl) as loader:
      next(iter(loader))
    return ctl.call("loaded")[0]


def _python(code: str) -> tuple[float, float]:
  probe = (f"{code}\nprint(int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]))")
  t0 = time.perf_counter()
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       check=True, env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout
  return time.perf_counter() - t0, int(out.split()[-1]) / 1024


def _loaded(work: pathlib.Path, module: str) -> list[str]:
  """The frameworks a sidecar serving ``module`` has loaded once ready (imported here)."""
  code = (f"import sys; sys.path.insert(0, {str(work)!r}); "
          "from sidecar._src.tools import cli; from sidecar._src.server import server; "
          f"import {module}; "
          f"print(','.join(m for m in {_FRAMEWORKS!r} if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout
  return [m for m in out.strip().split(",") if m]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5, help="starts per row (default 5)")
  args = parser.parse_args(argv)
  print("load average at start:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
  rows_run = {r: v for r, v in ROWS.items()
              if v[0] != "feed" or importlib.util.find_spec("torch") is not None}
  times: dict[str, list[float]] = {r: [] for r in rows_run}
  rss: dict[str, list[float]] = {r: [] for r in rows_run}
  with tempfile.TemporaryDirectory(prefix="sidecar-start-") as d:
    work = pathlib.Path(d)
    modules = {}
    for i, (row, (kind, code)) in enumerate(rows_run.items()):
      if kind in ("serve", "feed"):
        (work / f"start_fns_{i}.py").write_text(code)
        modules[row] = f"start_fns_{i}"
    loaded = {row: _loaded(work, m) for row, m in modules.items()}
    n = 0
    for r in range(args.rounds):
      order = list(rows_run)
      order = order[r % len(order):] + order[:r % len(order)]
      for row in order:
        kind, code = rows_run[row]
        n += 1
        if kind == "python":
          s, m = _python(code)
        else:
          s, m, after = _serve(work, modules[row], n, feed=kind == "feed")
          if after is not None:
            loaded[row] = after
        times[row].append(s)
        rss[row].append(m)
  lean = "sidecar serve, framework-free module"
  t0, m0 = statistics.median(times[lean]), statistics.median(rss[lean])
  rows = []
  for row in rows_run:
    t, m = statistics.median(times[row]), statistics.median(rss[row])
    rows.append([row, f"{t:.2f} ({min(times[row]):.2f}-{max(times[row]):.2f})",
                 f"{t / t0:.2f}x", f"{m:.0f} ({min(rss[row]):.0f}-{max(rss[row]):.0f})",
                 f"{m / m0:.2f}x", ", ".join(loaded.get(row, [])) or "-"])
  print(table(["start", "s to ready (min-max)", "vs lean", "RSS MiB (min-max)", "vs lean",
               "frameworks loaded at start (after the feed)"], rows))
  print(f"medians of {args.rounds}; load average at end:",
        " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
  main()
