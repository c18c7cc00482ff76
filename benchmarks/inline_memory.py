"""The sidecar's peak RSS growth for one 128 MiB inline call, as a ratio of its payload,
idle and beside busy processes (issue 54 item 7: under 1.8x with a margin).

Each repeated: a Controller's call (CallParts) of ``size_of`` (the argument only), of
``add`` (a new array of its size back) and of ``echo`` (the argument back), and one unary
Call of ``size_of`` and ``echo`` (a client that does not send parts: a non-Python client,
``benchmarks.attacks``' item 8).

  PYTHONPATH=. python -m benchmarks.inline_memory --repeat 5 --busy 2
"""

from __future__ import annotations

import argparse
import multiprocessing
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


def _growth(pid: int, call) -> float:
  """How far ``call()`` raises ``pid``'s peak RSS, as a ratio of the payload."""
  time.sleep(0.3)
  _reset_peak(pid)
  before, _ = _proc(pid)
  call()
  after, _ = _proc(pid)
  return (after - before) / MIB


def measure(cluster, repeat: int) -> dict[str, list[float]]:
  pid = cluster.pid(0)
  out: dict[str, list[float]] = {}
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
  fmt = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}x"
  print(f"one {MIB} MiB inline call: the sidecar's peak RSS growth / payload, "
        f"{a.repeat} calls each (min-max)")
  print(table(["call", "idle", f"beside {a.busy} busy processes"],
              [[k, fmt(idle[k]), fmt(loaded[k])] for k in idle]))


if __name__ == "__main__":
  main()
