"""The sidecar's peak RSS growth for one 128 MiB inline call, as a ratio of its payload,
idle and beside busy processes (issue 54 item 7: under 1.8x with a margin), and the
calling process's own (the Controller's, receiving the result).

Each repeated: a Controller's call (CallParts) of ``size_of`` (the argument only), of
``add`` (a new array of its size back) and of ``echo`` (the argument back), and one unary
Call of ``size_of`` and ``echo`` (a client that does not send parts: a non-Python client,
``benchmarks.attacks``' item 8).

  PYTHONPATH=. python -m benchmarks.inline_memory --repeat 5 --busy 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import numpy as np

import sidecar
from benchmarks.attacks import _handshake, _proc, _raw, _reset_peak
from benchmarks.common import table
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb

MIB = 128


def _busy() -> None:
  while True:
    pass


def _growth(pid: int, call) -> tuple[float, float]:
  """How far ``call()`` raises ``pid``'s peak RSS and this process's, as ratios of the
  payload."""
  time.sleep(0.3)
  here = os.getpid()
  _reset_peak(pid)
  _reset_peak(here)
  before, _ = _proc(pid)
  before_here, _ = _proc(here)
  call()
  after, _ = _proc(pid)
  after_here, _ = _proc(here)
  return (after - before) / MIB, (after_here - before_here) / MIB


def measure(cluster, repeat: int) -> dict[str, list[tuple[float, float]]]:
  pid = cluster.pid(0)
  out: dict[str, list[tuple[float, float]]] = {}
  big = np.arange(MIB << 20, dtype=np.uint8)
  with cluster.controller(attach=False, connect_timeout=10) as ctl:
    for fn in ("size_of", "add", "echo"):
      ctl.call(fn, args=(np.ones(1 << 20, np.uint8),))  # warm
      out[f"{fn}, in parts"] = [_growth(pid, lambda fn=fn: ctl.call(fn, args=(big,), timeout=120))
                                for _ in range(repeat)]
  channel, call = _raw(cluster, "Call")
  metadata = _handshake(channel)
  for fn in ("size_of", "echo"):
    raw = pb.CallRequest(name=fn, args=codec.encode((big,), inline_limit=1 << 40),
                         kwargs=codec.encode({})).SerializeToString()
    send = lambda raw=raw: call(raw, metadata=metadata, timeout=120)  # noqa: E731
    out[f"{fn}, one Call"] = [_growth(pid, send) for _ in range(repeat)]
  channel.close()
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeat", type=int, default=3)
  parser.add_argument("--busy", type=int, default=2, help="busy-loop processes for 'loaded'")
  a = parser.parse_args()
  ctx = multiprocessing.get_context("spawn")
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=["tests.support.sidecar_fns"],
                                    configure_jax=False) as cluster:
    idle = measure(cluster, a.repeat)
    busy = [ctx.Process(target=_busy, daemon=True) for _ in range(a.busy)]
    for p in busy:
      p.start()
    try:
      loaded = measure(cluster, a.repeat)
    finally:
      for p in busy:
        p.terminate()
        p.join(5)
  fmt = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}x"  # noqa: E731

  def cells(name: str, who: int) -> list[str]:  # who: 0 the sidecar, 1 the caller
    return [fmt([g[who] for g in runs[name]]) for runs in (idle, loaded)]

  print(f"one {MIB} MiB inline call: peak RSS growth / payload, {a.repeat} calls each "
        "(min-max), of the sidecar and of the calling process")
  print(table(["call", "sidecar, idle", f"sidecar, beside {a.busy} busy processes",
               "caller, idle", f"caller, beside {a.busy} busy"],
              [[name, *cells(name, 0), *cells(name, 1)] for name in idle]))


if __name__ == "__main__":
  main()
