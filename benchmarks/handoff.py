"""Moving a batch from the sidecar into a jax.Array in the worker, against the alternatives.

Run from the repository root: ``python -m benchmarks.handoff``. Not run by CI.

Rows, for a 4.8 MB batch (32x224x224x3 uint8) and a 64 MiB array:
  memcpy      one copy into a pre-faulted buffer: the limit (the same buffer each
              time, so for 4.8 MB both sides stay in cache)
  memcpy ring one copy into each of 4 pre-faulted slots in turn: what any producer
              that copies a finished batch into a ring of slots pays
  made in    the producer made the batch in an arena block (sidecar.empty; feeds
  the arena  write elements there): only a descriptor crosses, and a view of the
              block becomes the jax.Array; no copy at all (the handoff alone)
  copied     the batch sits in ordinary sidecar memory: the sidecar copies it into
              an arena block once, then as above; by ctl.stream (credits,
              `prefetch` ahead) and by ctl.call with `depth` calls in flight
  mp.Queue    multiprocessing.Queue with pickle from a spawned producer
  gRPC bytes  the same bytes in a gRPC response on loopback (a service without shm)
And the round trip of a no-op ctl.call against a raw gRPC unary call (to a server in
this process) and against the same request sent to the sidecar with no controller: by a
controller that maps the host's arena (its calls go over the Worker's Unix socket) and by
one that does not (over gRPC, as to a host on another machine).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
from concurrent import futures

import grpc
import jax
import numpy as np

import sidecar
from benchmarks.common import latencies, pct, rate, table
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb

SIZES = {"4.8 MB batch": 32 * 224 * 224 * 3, "64 MiB array": 64 << 20}


def bench_memcpy(nbytes: int, seconds: float) -> float:
  src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
  dst = np.ones(nbytes, np.uint8)  # pre-faulted
  return rate(lambda: np.copyto(dst, src), seconds=seconds)[0]


def bench_memcpy_ring(nbytes: int, seconds: float, slots: int = 4) -> float:
  src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
  ring = [np.ones(nbytes, np.uint8) for _ in range(slots)]
  i = iter(range(1 << 62))
  return rate(lambda: np.copyto(ring[next(i) % slots], src), seconds=seconds)[0]


def bench_sidecar(ctl, device, nbytes: int, seconds: float, depth: int) -> float:
  pending = collections.deque()

  def step():
    while len(pending) < depth:
      pending.append(ctl.call_async("source", args=(nbytes,), hosts=[0])[0])
    x = jax.device_put(pending.popleft().result(), device)
    x.block_until_ready()

  per_s = rate(step, seconds=seconds)[0]
  for f in pending:
    f.result()
  return per_s


def bench_stream(ctl, device, nbytes: int, seconds: float, prefetch: int,
                 name: str = "source_stream") -> float:
  with ctl.stream(name, args=(nbytes,), host=0, prefetch=prefetch, device=device) as s:
    return rate(lambda: next(s).block_until_ready(), seconds=seconds)[0]


def _producer(q, nbytes: int, count: int) -> None:
  a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
  for _ in range(count):
    q.put(a)


def bench_queue(device, nbytes: int, seconds: float) -> float:
  ctx = mp.get_context("spawn")
  q = ctx.Queue(maxsize=4)
  count = 100000
  p = ctx.Process(target=_producer, args=(q, nbytes, count), daemon=True)
  p.start()
  try:
    return rate(lambda: jax.device_put(q.get(), device).block_until_ready(), seconds=seconds)[0]
  finally:
    p.kill()
    p.join()


def _raw_server(payloads: dict[int, bytes]) -> tuple[grpc.Server, int]:
  def get(request: bytes, context) -> bytes:
    return payloads.get(int.from_bytes(request or b"\0", "little"), b"")
  server = grpc.server(futures.ThreadPoolExecutor(8), options=[
      ("grpc.max_send_message_length", 128 << 20), ("grpc.max_receive_message_length", 128 << 20)])
  server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
      "bench.Raw", {"Get": grpc.unary_unary_rpc_method_handler(get)}),))
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  return server, port


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seconds", type=float, default=2.0)
  ap.add_argument("--depth", type=int, default=2, help="ctl.call calls in flight")
  ap.add_argument("--prefetch", type=int, default=8, help="ctl.stream items ahead")
  ap.add_argument("--round-trip-only", action="store_true",
                  help="only the no-op ctl.call against a raw gRPC unary")
  args = ap.parse_args()
  s = args.seconds
  device = jax.devices()[0]
  payloads = {n: np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).tobytes()
              for n in SIZES.values()}
  payloads[0] = b""
  server, port = _raw_server(payloads)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
      ("grpc.max_receive_message_length", 128 << 20)])
  raw = channel.unary_unary("/bench.Raw/Get")

  rows = []
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="512MiB",
                                    imports=["benchmarks.handoff_fns"]) as cluster:
    with cluster.controller() as ctl:
      for label, n in ({} if args.round_trip_only else SIZES).items():
        limit = bench_memcpy(n, s)
        ring = bench_memcpy_ring(n, s)
        streamed = bench_stream(ctl, device, n, s, args.prefetch)
        in_place = bench_stream(ctl, device, n, s, args.prefetch, "made_in_arena")
        ours = bench_sidecar(ctl, device, n, s, args.depth)
        key = n.to_bytes(8, "little")
        grpc_bytes = rate(lambda key=key: jax.device_put(
            np.frombuffer(raw(key), np.uint8), device).block_until_ready(), seconds=s)[0]
        queue = bench_queue(device, n, s)
        for name, per_s in (("memcpy (limit)", limit), ("memcpy into a 4-slot ring", ring),
                            (f"ctl.stream, made in the arena, prefetch {args.prefetch}", in_place),
                            (f"ctl.stream, copied into the arena, prefetch {args.prefetch}",
                             streamed),
                            (f"sidecar ctl.call, depth {args.depth}", ours),
                            ("mp.Queue + pickle", queue), ("gRPC bytes, loopback", grpc_bytes)):
          rows.append((label, name, f"{per_s:,.0f}", f"{per_s * n / 1e9:.2f}",
                       f"{per_s / limit:.0%}", f"{per_s / ring:.0%}"))
      # The request ctl.call sends over gRPC, sent with no controller around it: what the
      # sidecar and the process boundary cost apart from the controller.
      conn = ctl._sidecars.conns[0]
      noop = pb.CallRequest(name="noop", args=codec.encode(()), kwargs=codec.encode({}))
      # Interleaved rounds, so that all see the same load on a shared machine.
      ours_rt, grpc_rt, raw_rt, direct_rt = [], [], [], []
      with cluster.controller(attach=False) as remote:  # maps no arena: calls over gRPC
        for _ in range(4):
          ours_rt += latencies(lambda: ctl.call("noop", hosts=[0]), n=500)
          grpc_rt += latencies(lambda: remote.call("noop", hosts=[0]), n=500)
          raw_rt += latencies(lambda: raw(b"\0"), n=500)
          direct_rt += latencies(
              lambda: conn.call_rpc(noop, timeout=30, metadata=conn.metadata), n=500)
      for x in (ours_rt, grpc_rt, raw_rt, direct_rt):
        x.sort()
  server.stop(0)
  if rows:
    print(table(("size", "path", "per s", "GB/s", "vs memcpy", "vs ring memcpy"), rows))
    print()
  rt_rows = [(name, f"{pct(rt, 50) * 1e3:.3f}", f"{pct(rt, 99) * 1e3:.3f}",
              f"{pct(rt, 50) / pct(raw_rt, 50):.2f}x")
             for name, rt in (("raw gRPC unary", raw_rt),
                              ("gRPC unary to the sidecar's Call, no controller", direct_rt),
                              ("ctl.call no-op, over gRPC (a controller that maps no arena)",
                               grpc_rt),
                              ("ctl.call no-op (this process maps the arena: its Unix socket)",
                               ours_rt))]
  print(table(("round trip", "p50 ms", "p99 ms", "p50 vs raw"), rt_rows))


if __name__ == "__main__":
  main()
