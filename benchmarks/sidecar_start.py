"""What a sidecar costs to start: seconds until ``--ready-file`` is written, and its RSS then.

``python -m benchmarks.sidecar_start [--rounds N]``: ``sidecar serve`` started N times per
row, rows taking turns round by round (so load on the machine falls on all alike), each
stopped with SIGTERM once ready. Rows:

- a module that registers one framework-free function (a lean sidecar: nothing but the
  sidecar's own start);
- the same module with ``import jax`` at its top (a sidecar whose registered code needs JAX:
  what every sidecar paid while the sidecar's own modules imported it at start);
- the same with ``import grain`` (Grain brings JAX, Orbax and TensorStore);
- the interpreter alone, and ``import jax`` alone, for scale.

Prints medians (min-max) and each row against the lean one, with the load average.
"""

from __future__ import annotations

import argparse
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
ROWS = {
    "sidecar serve, framework-free module": ("serve", LEAN),
    "sidecar serve, module imports jax": ("serve", "import jax\n" + LEAN),
    "sidecar serve, module imports grain": ("serve", "import grain\n" + LEAN),
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


def _serve(work: pathlib.Path, module: str, n: int) -> tuple[float, float]:
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
    seconds = time.perf_counter() - t0
    return seconds, _rss_mib(p.pid)
  finally:
    p.send_signal(signal.SIGTERM)
    try:
      p.wait(30)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


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
  times: dict[str, list[float]] = {r: [] for r in ROWS}
  rss: dict[str, list[float]] = {r: [] for r in ROWS}
  with tempfile.TemporaryDirectory(prefix="sidecar-start-") as d:
    work = pathlib.Path(d)
    modules = {}
    for i, (row, (kind, code)) in enumerate(ROWS.items()):
      if kind == "serve":
        (work / f"start_fns_{i}.py").write_text(code)
        modules[row] = f"start_fns_{i}"
    loaded = {row: _loaded(work, m) for row, m in modules.items()}
    n = 0
    for r in range(args.rounds):
      order = list(ROWS)
      order = order[r % len(order):] + order[:r % len(order)]
      for row in order:
        kind, code = ROWS[row]
        n += 1
        s, m = _serve(work, modules[row], n) if kind == "serve" else _python(code)
        times[row].append(s)
        rss[row].append(m)
  lean = "sidecar serve, framework-free module"
  t0, m0 = statistics.median(times[lean]), statistics.median(rss[lean])
  rows = []
  for row in ROWS:
    t, m = statistics.median(times[row]), statistics.median(rss[row])
    rows.append([row, f"{t:.2f} ({min(times[row]):.2f}-{max(times[row]):.2f})",
                 f"{t / t0:.2f}x", f"{m:.0f} ({min(rss[row]):.0f}-{max(rss[row]):.0f})",
                 f"{m / m0:.2f}x", ", ".join(loaded.get(row, [])) or "-"])
  print(table(["start", "s to ready (min-max)", "vs lean", "RSS MiB (min-max)", "vs lean",
               "frameworks loaded at start"], rows))
  print(f"medians of {args.rounds}; load average at end:",
        " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
  main()
