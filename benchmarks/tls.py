"""What TLS and mTLS on the control port cost: ``ctl.call`` round trips and feed batches/s.

Three 1-host LocalClusters in turn (plaintext, TLS, mTLS; the test certificates of
tests/data/tls), each measured with a controller attached to the arena (calls over gRPC,
batches over the Unix socket) and one that is not (everything over gRPC). Ratios are
against plaintext, measured in the same run.

  python -m benchmarks.tls --seconds 3
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from benchmarks.common import latencies, pct, rate, table

TLS = pathlib.Path(__file__).parent.parent / "tests" / "data" / "tls"
SERVER = ["--tls-cert", str(TLS / "server.pem"), "--tls-key", str(TLS / "server.key")]
MODES = {
    "plaintext": ([], {}),
    "TLS": (SERVER, {"tls_ca": str(TLS / "ca.pem")}),
    "mTLS": (SERVER + ["--tls-client-ca", str(TLS / "ca.pem")],
             {"tls_ca": str(TLS / "ca.pem"), "tls_cert": str(TLS / "client.pem"),
              "tls_key": str(TLS / "client.key")}),
}


def measure(args: argparse.Namespace, extra: list[str], tls: dict) -> dict[str, float]:
  out = {}
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  small, big = np.arange(16, dtype=np.float32), np.zeros(1 << 18, np.float32)  # 64 B, 1 MiB
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="256MiB",
                                    imports=["benchmarks.soak_fns"], extra_args=extra) as c:
    for attach in (True, False):
      path = "arena" if attach else "gRPC"
      with c.controller(attach=attach, **tls) as ctl:
        lat = latencies(lambda: ctl.call("echo", args=(small,)), n=args.calls, warmup=50)
        out[f"call 64 B p50 ms ({path})"] = pct(lat, 50) * 1e3
        lat = latencies(lambda: ctl.call("echo", args=(big,)), n=args.calls // 5, warmup=10)
        out[f"call 1 MiB p50 ms ({path})"] = pct(lat, 50) * 1e3
        with ctl.feed("soak_rows", global_batch_size=64, sharding=sharding) as feed:
          out[f"feed batches/s, 64 x 4 KiB ({path})"] = rate(
              lambda: jax.block_until_ready(next(feed)), seconds=args.seconds)[0]
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seconds", type=float, default=3.0)
  ap.add_argument("--calls", type=int, default=1000)
  args = ap.parse_args()
  results = {mode: measure(args, extra, tls) for mode, (extra, tls) in MODES.items()}
  keys = list(results["plaintext"])
  rows = []
  for k in keys:
    base = results["plaintext"][k]
    rows.append([k] + [f"{results[m][k]:.3g}" for m in MODES] +
                [f"{results[m][k] / base:.2f}x" for m in ("TLS", "mTLS")])
  print(table(["figure", *MODES, "TLS / plain", "mTLS / plain"], rows))


if __name__ == "__main__":
  main()
