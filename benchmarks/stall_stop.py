"""A hung trainer, found and stopped: ``sidecar launch --stall-timeout`` from the outside.

  python -m benchmarks.stall_stop [--rounds 3] [--stall-timeout 3] [--before DIR]
                                  [--standby | --no-standby]

From the repository root; not run by CI. Each round is one ``sidecar launch --hosts 1
--stall-timeout T --max-restarts 1 [--standby]`` of tests/support/stall_train.py, which takes
a batch of the sidecar's feed a step, saves every 4 steps and, after step 6 of its first
life, hangs in ``time.sleep`` (a blocked call: it burns nothing). The launcher's output is
read as it comes, each line stamped on arrival, and the hung process is watched in
``/proc`` every 5 ms. Issue 77's figures, per round:

  found     the stall line's arrival, less (the trainer's last step + T): how long after
            its timeout the stall was found (the last step as the stall line itself says:
            "no step for S s", S - T at the moment it was printed: 0.1 s resolution on
            trees before issue 77's; since, "found F s after it")
  stopped   the hung process gone from /proc (reaped), less the stall line's arrival
  new life  the launcher's "restart 1:" line (the new life told to run: the standby's
            take, or a fresh process), less the stop
  step      the new life's first step line, less the stop (its restore included)

``--before DIR`` runs the same rounds with another tree's ``sidecar`` (say main's checkout)
beside this one's, alternating, so that both see the same machine load: the ratio of each
figure, after / before, is what to read on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.common import table

ROOT = pathlib.Path(__file__).resolve().parents[1]
_FOUND = re.compile(r"found ([\d.]+) s after it\)")
_STALL = re.compile(r"stalled: no step for ([\d.]+) s since its last step \(its stall timeout "
                    r"([\d.]+) s")


def _gone(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
  except OSError:
    return True


def one_round(tree: pathlib.Path, timeout: float, standby: bool) -> dict:
  """One launch from ``tree``: the figures of its one hang (seconds), or an error."""
  with tempfile.TemporaryDirectory(prefix="stall-stop-") as work:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(  # the tree first, then what was set
        [str(tree), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size",
               "16MiB", "--import", "tests.support.feed_fns", "--stall-timeout", f"{timeout:g}",
               "--max-restarts", "1", *(["--standby"] if standby else []), "--",
               sys.executable, "-m", "tests.support.stall_train", os.path.join(work, "ckpt"),
               "sleep", "1", f"{timeout:g}"]
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    got: dict = {}
    watch: dict = {}

    def watch_pid() -> None:  # the hung process's end, as /proc shows it
      while "pid" not in watch:
        if proc.poll() is not None:
          return
        time.sleep(0.005)
      while not _gone(watch["pid"]):
        time.sleep(0.005)
      watch["gone"] = time.monotonic()

    watcher = threading.Thread(target=watch_pid)
    watcher.start()
    lines = []
    assert proc.stdout is not None
    for raw in proc.stdout:
      now = time.monotonic()
      line = raw.decode(errors="replace").rstrip()
      lines.append(line)
      if (m := re.search(r"RESULT (\{.*\})", line)) is not None:
        r = json.loads(m.group(1))
        if r["kind"] == "hanging":
          watch["pid"] = r["pid"]
        if r["kind"] == "step" and r["restart"] == 1 and "step" not in got:
          got["step"] = now
      elif (m := _STALL.search(line)) is not None and "found" not in got:
        late = _FOUND.search(line)  # this tree's line says it to the hundredth
        got["found"] = now
        got["late"] = float(late.group(1)) if late else float(m.group(1)) - float(m.group(2))
      elif "restart 1:" in line and "restart" not in got:
        got["restart"] = now
    code = proc.wait()
    watch.setdefault("pid", -1)
    watcher.join()
  if code != 0 or not {"found", "restart", "step"} <= set(got) or "gone" not in watch:
    return {"error": f"exit {code}; " + "\n".join(lines[-15:])}
  stop = watch["gone"]
  return {"found": got["late"], "stopped": stop - got["found"],
          "new_life": got["restart"] - stop, "step": got["step"] - stop}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--stall-timeout", type=float, default=3.0)
  p.add_argument("--before", default=None, help="another tree's checkout, run alternately")
  p.add_argument("--no-standby", dest="standby", action="store_false")
  args = p.parse_args(argv)
  trees = {"after": ROOT} | ({"before": pathlib.Path(args.before).resolve()}
                             if args.before else {})
  figures: dict[str, list[dict]] = {name: [] for name in trees}
  for i in range(args.rounds):
    for name, tree in trees.items():
      r = one_round(tree, args.stall_timeout, args.standby)
      print(f"round {i + 1} {name}: {json.dumps(r)}", flush=True)
      if "error" not in r:
        figures[name].append(r)
  keys = ("found", "stopped", "new_life", "step")
  rows = []
  for name, rs in figures.items():
    if rs:
      rows.append([name, len(rs)] + [
          f"{statistics.median(r[k] for r in rs):.3f} ({min(r[k] for r in rs):.3f}-"
          f"{max(r[k] for r in rs):.3f})" for k in keys])
  print(f"\nstall timeout {args.stall_timeout:g} s, standby {args.standby}; seconds, median "
        "(min-max)")
  print(table(["tree", "rounds", "found after the timeout", "stopped after found",
               "new life after the stop", "first step after the stop"], rows))
  if len(rows) == 2 and all(figures.values()):
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys}
           for name, rs in figures.items()}
    ratio = [f"{med['after'][k] / max(1e-9, med['before'][k]):.2f}x" for k in keys]
    print(table(["after / before", *keys], [["ratio", *ratio]]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
