"""What the goodput ledger costs a training loop per step, measured in one run.

Run from the repository root: ``python -m benchmarks.goodput_overhead``. Not run by CI.

Two figures, each with its baseline in the same run:
(a) the ledger client's per-batch path alone (``LedgerClient.batch``: adds, a compare), in
    ns a call against an empty loop, with the socket's mark every 5 s included (the
    ledger client bound to a real sidecar's worker session);
(b) a real feed on a 1-host LocalCluster (small batches, so the per-batch overhead shows
    most): batches/s taken with the ledger client against without (the Controller's
    ledger client dropped), ROUNDS interleaved rounds of each, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
from jax.sharding import SingleDeviceSharding

import sidecar
from benchmarks.common import table


def _per_call_ns(fn, n: int) -> float:
  t0 = time.perf_counter()
  for _ in range(n):
    fn(0.0, time.perf_counter())
  return (time.perf_counter() - t0) / n * 1e9


def client_alone(ctl, n: int) -> tuple[float, float]:
  """ns per call of the bound ledger client's ``batch`` and of an empty callback."""
  client = ctl._goodput
  assert client is not None, "process 0's Controller records"
  empty = lambda blocked, now: None
  _per_call_ns(client.batch, n // 10)  # warm
  return _per_call_ns(client.batch, n), _per_call_ns(empty, n)


def feed_rate(ctl, *, record: bool, seconds: float, sharding) -> float:
  """Batches/s taken from a new feed for ``seconds`` (after a warm-up)."""
  saved = ctl._goodput
  if not record:
    ctl._goodput = None  # the feed is made with no ledger client to tell
  try:
    with ctl.feed("ids", kwargs={"n": 1 << 30}, global_batch_size=8,
                  sharding=sharding) as feed:
      for _ in range(50):
        next(feed)
      n, t0 = 0, time.perf_counter()
      while time.perf_counter() - t0 < seconds:
        next(feed)
        n += 1
      return n / (time.perf_counter() - t0)
  finally:
    ctl._goodput = saved


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each")
  p.add_argument("--seconds", type=float, default=2.0, help="seconds a round")
  p.add_argument("--calls", type=int, default=2_000_000, help="calls of (a)")
  args = p.parse_args()
  sharding = SingleDeviceSharding(jax.devices()[0])
  with tempfile.TemporaryDirectory() as tmp, sidecar.testing.LocalCluster(
      1, 1, shm_size="64MiB", imports=["benchmarks.goodput_fns"],
      checkpoint_roots=[tmp]) as cluster, cluster.controller() as ctl:
    ctl.checkpointer(os.path.join(tmp, "ckpt"))  # binds the ledger: marks go to the sidecar
    with_ns, empty_ns = client_alone(ctl, args.calls)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
      for record in (False, True):
        rates[record].append(feed_rate(ctl, record=record, seconds=args.seconds,
                                       sharding=sharding))
  on, off = statistics.median(rates[True]), statistics.median(rates[False])
  print(table(["what", "without", "with the ledger client", "ratio"], [
      ["(a) per-batch call, ns", f"{empty_ns:.0f}", f"{with_ns:.0f}",
       f"+{with_ns - empty_ns:.0f} ns"],
      ["(b) feed, batches/s (median)", f"{off:.0f}", f"{on:.0f}", f"{on / off:.3f}x"],
  ]))
  print(f"(b) rounds without: {[round(x) for x in rates[False]]}, "
        f"with: {[round(x) for x in rates[True]]}")


if __name__ == "__main__":
  main()
