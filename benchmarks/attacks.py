"""The attacks of issue 16 that the bounds stop, each run once, with what it got.

Run it against two trees to get a before/after table (the same script, either code):

  PYTHONPATH=/path/to/old/tree python -m benchmarks.attacks
  PYTHONPATH=. SIDECAR_PEER_TIMEOUT=10 python -m benchmarks.attacks

Each attack uses only what both trees have (LocalCluster, Controller, raw gRPC, the raw
Unix socket). A hung-sidecar attack gives up after ``--give-up`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import struct
import threading
import time

import grpc
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from benchmarks.common import table
from sidecar._src import codec, ipc, protocol
from sidecar._src.protocol import pb

FNS = ["benchmarks.soak_fns"]


def _handshake(channel) -> list:
  rpc = channel.unary_unary(f"/{protocol.SERVICE}/Handshake",
                            request_serializer=pb.HandshakeRequest.SerializeToString,
                            response_deserializer=pb.HandshakeResponse.FromString)
  reply = rpc(pb.HandshakeRequest(versions=protocol.local_versions()), timeout=10)
  return [(protocol.SESSION_KEY, reply.session)]


def hung_feed(cluster, *, attach: bool, give_up: float) -> str:
  """A feed whose sidecar is SIGSTOPped: how long until next() raises."""
  n = cluster.num_hosts
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:n]), ("data",)), P("data"))
  ctl = cluster.controller(attach=attach)
  feed = ctl.feed("soak_rows", global_batch_size=4 * n, sharding=sharding)
  next(feed)
  pid = cluster.pid(0)
  os.kill(pid, signal.SIGSTOP)
  t0 = time.monotonic()
  out: queue.SimpleQueue = queue.SimpleQueue()

  def consume():
    try:
      for _ in range(10_000):
        next(feed)
      out.put("no error")
    except Exception as e:
      out.put(f"{type(e).__name__} after {time.monotonic() - t0:.1f} s")
  threading.Thread(target=consume, daemon=True).start()
  try:
    result = out.get(timeout=give_up)
  except queue.Empty:
    result = f"still blocked after {give_up:.0f} s"
  os.kill(pid, signal.SIGCONT)
  time.sleep(0.5)
  feed.close()
  ctl.close()
  return result


def silent_streams(cluster, count: int = 32) -> str:
  """``count`` streams that never send a credit, then a new controller's handshake."""
  channel = grpc.insecure_channel(cluster.addresses[0])
  stream = channel.stream_stream(f"/{protocol.SERVICE}/Stream",
                                 request_serializer=pb.StreamRequest.SerializeToString,
                                 response_deserializer=pb.StreamItem.FromString)
  queues, calls, refused = [], [], 0
  sessions = [_handshake(channel) for _ in range(-(-count // 8))]  # 8 streams a session
  for i in range(count):
    metadata = sessions[i // 8]
    q: queue.SimpleQueue = queue.SimpleQueue()
    q.put(pb.StreamRequest(start=pb.CallRequest(
        name="echo_items_forever", args=codec.encode(()), kwargs=codec.encode({})), prefetch=1))
    call = stream(iter(q.get, None), metadata=metadata, timeout=60)
    queues.append(q)
    calls.append(call)
  time.sleep(1.0)
  for call in calls:
    if call.done() and call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
      refused += 1
  t0 = time.monotonic()
  try:
    with sidecar.Controller(cluster.addresses[:1], connect_timeout=10, timeout=10,
                            attach=False) as ctl:
      ctl.call("echo", args=(1,))
    result = f"handshake and call OK in {time.monotonic() - t0:.2f} s"
  except sidecar.SidecarError as e:
    result = f"{type(e).__name__} after {time.monotonic() - t0:.1f} s"
  for q, call in zip(queues, calls):
    q.put(None)
    call.cancel()
  channel.close()
  return f"{refused} of {count} refused (RESOURCE_EXHAUSTED); {result}"


def _attach(path: str) -> socket.socket:
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.settimeout(5)
  sock.connect(path)
  ipc.send(sock, {"op": "attach", "pid": os.getpid(),
                  "versions": protocol.versions_dict(protocol.local_versions())})
  _, fds = ipc.recv(sock, max_fds=1)
  for fd in fds:
    os.close(fd)
  return sock


def malformed_frame(cluster, data: bytes) -> str:
  sock = _attach(cluster.socket(0))
  sock.sendall(struct.pack("<I", len(data)) + data)
  try:
    reply, _ = ipc.recv(sock)
    return f"answered: {reply['error']['type']}"
  except (ConnectionError, OSError) as e:
    return f"no answer: connection dropped ({type(e).__name__})"
  finally:
    sock.close()


def idle_connections(cluster, count: int = 300) -> str:
  """``count`` connections to the worker socket that say nothing: the sidecar's threads."""
  pid = cluster.pid(0)
  before = _threads(pid)
  socks, refused = [], 0
  for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(cluster.socket(0))
    socks.append(s)
  time.sleep(1.0)
  peak = _threads(pid)
  for s in socks:
    s.setblocking(False)
    try:
      if s.recv(65536):
        refused += 1
    except BlockingIOError:
      pass
    s.close()
  return f"sidecar threads {before} -> {peak}; {refused} refused with an answer"


def _threads(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def huge_prefetch(cluster) -> str:
  channel = grpc.insecure_channel(cluster.addresses[0])
  metadata = _handshake(channel)
  stream = channel.stream_stream(f"/{protocol.SERVICE}/Stream",
                                 request_serializer=pb.StreamRequest.SerializeToString,
                                 response_deserializer=pb.StreamItem.FromString)
  start = pb.CallRequest(name="echo_items_forever", args=codec.encode(()),
                         kwargs=codec.encode({}))
  call = stream(iter([pb.StreamRequest(start=start, prefetch=10**9)]), metadata=metadata,
                timeout=3)
  try:
    n = sum(1 for _ in call)
    result = f"accepted: {n} items sent ahead in 3 s"
  except grpc.RpcError as e:
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
      result = "accepted: ran ahead until the 3 s deadline"
    else:
      result = f"refused: {e.code().name}"
  channel.close()
  return result


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--give-up", type=float, default=45.0)
  ap.add_argument("--label", default="this tree")
  args = ap.parse_args()
  rows = []
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB",
                                    imports=FNS) as cluster:
    rows.append(["32 streams that never send a credit, then a new controller",
                 silent_streams(cluster)])
    rows.append(["frame {'op': 'free', 'blocks': 5}", malformed_frame(
        cluster, json.dumps({"op": "free", "blocks": 5}).encode())])
    rows.append(["frame of invalid UTF-8", malformed_frame(cluster, b'{"op": "\xff"}')])
    rows.append(["300 idle worker-socket connections", idle_connections(cluster)])
    rows.append(["a stream with prefetch=10**9", huge_prefetch(cluster)])
    rows.append(["SIGSTOPped sidecar, feed over the Unix socket",
                 hung_feed(cluster, attach=True, give_up=args.give_up)])
    rows.append(["SIGSTOPped sidecar, feed over gRPC",
                 hung_feed(cluster, attach=False, give_up=args.give_up)])
  print(f"\nattacks against {args.label} (SIDECAR_PEER_TIMEOUT="
        f"{os.environ.get('SIDECAR_PEER_TIMEOUT', 'unset')})\n")
  print(table(["attack", "outcome"], rows))


if __name__ == "__main__":
  main()
