"""The attacks of issues 16 and 23 that the bounds stop, each run once, with what it got.

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
import tempfile
import threading
import time

import grpc
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from benchmarks.common import table
from sidecar._src.wire import codec, ipc, protocol
from sidecar._src.wire.protocol import pb

FNS = ["benchmarks.soak_fns", "benchmarks.attacks_fns"]


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
    with sidecar.jax.Controller(cluster.addresses[:1], connect_timeout=10, timeout=10,
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


def _reset_peak(pid: int) -> None:
  """Starts the sidecar's peak RSS (VmHWM) afresh from its RSS now."""
  with open(f"/proc/{pid}/clear_refs", "w") as f:
    f.write("5")


def _proc(pid: int) -> tuple[float, float]:
  """The sidecar's peak RSS (MiB) and CPU time (s) so far."""
  with open(f"/proc/{pid}/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return hwm, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _raw(cluster, rpc: str):
  channel = grpc.insecure_channel(cluster.addresses[0], options=[
      ("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)])
  return channel, channel.unary_unary(f"/{protocol.SERVICE}/{rpc}")


def many_nones(cluster, count: int = 8_000_000) -> str:
  """One Call whose argument is ``count`` ``none`` values (4 bytes each on the wire)."""
  channel, call = _raw(cluster, "Call")
  metadata = _handshake(channel)
  items = pb.ListValue(items=[pb.Value(none=True)] * count)
  raw = pb.CallRequest(name="echo", args=pb.Value(tuple=pb.ListValue(items=[
      pb.Value(list=items)])), kwargs=codec.encode({})).SerializeToString()
  del items
  _reset_peak(cluster.pid(0))
  hwm, cpu = _proc(cluster.pid(0))
  try:
    call(raw, metadata=metadata, timeout=120)
    outcome = "accepted"
  except grpc.RpcError as e:
    outcome = f"{e.code().name}: {e.details()[:60]}..."
  hwm2, cpu2 = _proc(cluster.pid(0))
  channel.close()
  return (f"{len(raw) / 2**20:.0f} MiB request: {outcome}; sidecar peak RSS +{hwm2 - hwm:.0f} "
          f"MiB, CPU {cpu2 - cpu:.2f} s")


def huge_batch(cluster) -> str:
  """A feed over a plain iterable whose batch (256 x 1 MiB rows) cannot fit a 64 MiB arena."""
  n = cluster.num_hosts
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:n]), ("data",)), P("data"))
  _reset_peak(cluster.pid(0))
  hwm, _ = _proc(cluster.pid(0))
  with cluster.controller(attach=False) as ctl:
    before = ctl.call("pulled")[0]
    try:
      with ctl.feed("huge_rows", global_batch_size=256 * n, sharding=sharding) as feed:
        next(feed)
      outcome = "a batch came"
    except sidecar.SidecarError as e:
      outcome = type(e).__name__
    rows = ctl.call("pulled")[0] - before
  hwm2, _ = _proc(cluster.pid(0))
  return f"{outcome} after {rows} rows read; sidecar peak RSS +{hwm2 - hwm:.0f} MiB"


def slow_calls(cluster, count: int = 60, seconds: float = 12.0) -> str:
  """``count`` calls of one session that each sleep ``seconds``, then a new controller."""
  channel, call = _raw(cluster, "Call")
  metadata = _handshake(channel)
  request = pb.CallRequest(name="nap", args=codec.encode((seconds,)),
                           kwargs=codec.encode({})).SerializeToString()
  calls = [call.future(request, metadata=metadata, timeout=60) for _ in range(count)]
  time.sleep(1.0)
  refused = sum(c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls)
  t0 = time.monotonic()
  try:
    with sidecar.jax.Controller(cluster.addresses[:1], connect_timeout=5, timeout=5,
                            attach=False) as ctl:
      ctl.status()
      ctl.call("echo", args=(1,))
    result = f"handshake, status and call OK in {time.monotonic() - t0:.2f} s"
  except sidecar.SidecarError as e:
    result = f"{type(e).__name__} after {time.monotonic() - t0:.1f} s"
  for c in calls:
    c.exception()  # every nap ends before the next attack
  channel.close()
  return f"{refused} of {count} refused (RESOURCE_EXHAUSTED); then a new controller: {result}"


def unauthenticated() -> str:
  """Handshake and Status without the token of a sidecar that has one: what comes back."""
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="8MiB",
                                    token="s3cret", imports=FNS) as cluster:
    out = []
    for rpc in ("Handshake", "Status"):
      channel, call = _raw(cluster, rpc)
      try:
        reply = call(pb.HandshakeRequest(versions=protocol.local_versions()).SerializeToString()
                     if rpc == "Handshake" else b"", timeout=10)
        out.append(f"{rpc}: answered, {len(reply)} bytes, hostname "
                   f"{'in' if socket.gethostname().encode() in reply else 'not in'} it")
      except grpc.RpcError as e:
        told = socket.gethostname() in e.details() or str(cluster.pid(0)) in e.details()
        out.append(f"{rpc}: {e.code().name}{', with identity' if told else ', nothing else'}")
      channel.close()
  return "; ".join(out)


def full_disk(tmp: str) -> str:
  """Step 2 fails with ENOSPC once its first shard is on disk; then the trainer's blocks,
  and step 3."""
  env = {"SIDECAR_CKPT_FAULT": "enospc@2"}
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB",
                                    imports=FNS, host_env={0: env}) as cluster:
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P())
    with cluster.controller() as ctl, ctl.checkpointer(os.path.join(tmp, "ck")) as ckpt:
      def state(v):
        return {"w": jax.device_put(np.full((1024, 1024), v, np.float32), sharding)}
      ckpt.save(1, state(1.0)).durable.result(60)
      try:
        ckpt.save(2, state(2.0)).durable.result(60)
        step2 = "saved (no enospc fault point in this tree)"
      except sidecar.SidecarError as e:
        step2 = f"{type(e).__name__} ({'ENOSPC' if 'No space' in str(e) else str(e)[:40]})"
      time.sleep(1.0)
      live = ctl.worker(0).live_blocks
      try:
        ckpt.save(3, state(3.0)).durable.result(60)
        step3 = f"durable; steps {ckpt.all_steps()}"
      except sidecar.SidecarError as e:
        step3 = f"{type(e).__name__}"
  return f"step 2: {step2}; trainer live_blocks after it: {live}; step 3: {step3}"


# ---- round 2 (issue 23) ----------------------------------------------------------------


def _fds(pid: int) -> int:
  return len(os.listdir(f"/proc/{pid}/fd"))


def _health(address: str) -> str:
  from grpc_health.v1 import health_pb2, health_pb2_grpc
  with grpc.insecure_channel(address) as ch:
    try:
      status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.RpcError as e:
      return e.code().name
  return health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)


def _idle(port: int, count: int) -> list[socket.socket]:
  return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def _closed(conns: list[socket.socket]) -> int:
  """How many of ``conns`` the server closed."""
  n = 0
  for c in conns:
    c.setblocking(False)
    try:
      while True:
        if not c.recv(1 << 16):
          n += 1
          break
    except BlockingIOError:
      pass
    except OSError:
      n += 1
  return n


def fd_exhaustion() -> str:
  """Item 1: idle health-port connections use up a sidecar's descriptors (its soft limit
  set to what it has open + 24); a worker attaches meanwhile; then once they close."""
  import resource
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=FNS, configure_jax=False) as cluster:
    pid = cluster.pid(0)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_fds(pid) + 24, hard))
    conns = _idle(int(cluster.health_addresses[0].rsplit(":", 1)[1]), 64)
    time.sleep(1.0)
    try:
      sidecar.jax.Worker(cluster.socket(0), timeout=2).close()
      during = "attached"
    except sidecar.SidecarError as e:
      during = type(e).__name__
    for c in conns:
      c.close()
    time.sleep(2.0)
    t0 = time.monotonic()
    try:
      sidecar.jax.Worker(cluster.socket(0), timeout=20).close()
      after = f"attached in {time.monotonic() - t0:.2f} s"
    except sidecar.SidecarError as e:
      after = f"{type(e).__name__} after {time.monotonic() - t0:.0f} s: {str(e)[-40:]}"
    return (f"a worker during the flood: {during}; after it: {after}; health "
            f"{_health(cluster.health_addresses[0])}")


def idle_side_ports() -> str:
  """Item 2: 200 idle connections to /metrics, 200 to the health port: threads, and how
  many the sidecar closed at once and after 15 s."""
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=FNS, configure_jax=False, metrics=True) as cluster:
    pid = cluster.pid(0)
    out = []
    for name, port in (("/metrics", int(cluster.metrics_urls[0].rsplit(":", 1)[1].split("/")[0])),
                       ("health", int(cluster.health_addresses[0].rsplit(":", 1)[1]))):
      threads = _threads(pid)
      conns = _idle(port, 200)
      time.sleep(1.0)
      at_once, grown = _closed(conns), _threads(pid) - threads
      time.sleep(15.0)
      later = _closed(conns)
      for c in conns:
        c.close()
      out.append(f"{name}: threads +{grown}, {at_once} closed at once, {later} after 15 s")
    return "; ".join(out)


def handshake_flood(count: int = 4200) -> str:
  """Item 5: ``count`` handshakes from one client, then a live controller's next call."""
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=FNS, configure_jax=False) as cluster:
    with cluster.controller(attach=False) as ctl:
      ctl.call("echo", args=(1,))
      channel, handshake = _raw(cluster, "Handshake")
      request = pb.HandshakeRequest(versions=protocol.local_versions()).SerializeToString()
      refused = 0
      for _ in range(count):
        try:
          handshake(request, timeout=10)
        except grpc.RpcError:
          refused += 1
      channel.close()
      try:
        ctl.call("echo", args=(1,))
        victim = "its next call OK"
      except sidecar.SidecarError as e:
        victim = f"its next call: {type(e).__name__}: {str(e)[:40]}..."
  return f"{refused} of {count} handshakes refused; {victim}"


def arena_hog(give_up: float) -> str:
  """Item 6: one worker takes what it can of a 64 MiB arena in 1 MiB blocks; another
  client's stream of 1 MiB items, then."""
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB",
                                    imports=FNS, configure_jax=False) as cluster:
    hog, held = sidecar.jax.Worker(cluster.socket(0)), []
    try:
      for _ in range(64):
        held.append(hog.empty((1 << 20,), np.uint8)[0])
      took = "all of it"
    except sidecar.SidecarError as e:
      took = f"{len(held)} MiB, then {type(e).__name__}"
    took = f"{len(held)} MiB" if took == "all of it" else took
    out: queue.SimpleQueue = queue.SimpleQueue()
    ctl = cluster.controller()
    t0 = time.monotonic()

    def consume():
      try:
        with ctl.stream("big_items", args=(3, 1 << 20)) as s:
          out.put(f"{len(list(s))} items")
      except Exception as e:
        out.put(f"{type(e).__name__} after {time.monotonic() - t0:.0f} s"
                + (" (with the sizes)" if "free of" in str(e) else ""))
    threading.Thread(target=consume, daemon=True).start()
    try:
      result = out.get(timeout=give_up)
    except queue.Empty:
      result = f"still blocked after {give_up:.0f} s"
    held.clear()
    hog.close()
    time.sleep(1.0)
    ctl.close()
  return f"the hog took {took}; the other's stream: {result}"


def inline_call(mib: int) -> str:
  """Item 8: one call with a ``mib`` MiB array inline (no arena): the sidecar's peak RSS."""
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=FNS, configure_jax=False) as cluster:
    channel, call = _raw(cluster, "Call")
    metadata = _handshake(channel)
    call(pb.CallRequest(name="size_of", args=codec.encode((np.ones(1 << 20, np.uint8),)),
                        kwargs=codec.encode({})).SerializeToString(), metadata=metadata,
         timeout=60)  # warm: the first call's imports and threads are not the payload's
    raw = pb.CallRequest(name="size_of", args=codec.encode(
        (np.ones(mib << 20, np.uint8),), inline_limit=1 << 40),
        kwargs=codec.encode({})).SerializeToString()
    time.sleep(1.0)
    _reset_peak(cluster.pid(0))
    hwm, _ = _proc(cluster.pid(0))
    try:
      call(raw, metadata=metadata, timeout=120)
      outcome = "OK"
    except grpc.RpcError as e:
      outcome = e.code().name
    hwm2, _ = _proc(cluster.pid(0))
    channel.close()
  grown = hwm2 - hwm
  return f"{outcome}; sidecar peak RSS +{grown:.0f} MiB ({grown / mib:.1f}x the payload)"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--give-up", type=float, default=45.0)
  ap.add_argument("--label", default="this tree")
  ap.add_argument("--round", type=int, choices=[1, 2], default=None,
                  help="only the first round's attacks (issue 16) or the second's (issue 23)")
  args = ap.parse_args()
  rows = []
  if args.round != 1:
    rows.append(["2. 200 idle connections to /metrics, then 200 to health", idle_side_ports()])
    rows.append(["5. 4,200 handshakes of one client, then a live controller's call",
                 handshake_flood()])
    rows.append(["6. one worker takes the arena; another client's stream of 1 MiB items",
                 arena_hog(max(args.give_up, 90.0))])
    for mib in (128, 200):
      rows.append([f"8. a call with a {mib} MiB array inline", inline_call(mib)])
    rows.append(["1. idle health connections use up the fds; a worker attaches, then after",
                 fd_exhaustion()])
    if args.round == 2:
      _print(args, rows)
      return
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB",
                                    imports=FNS) as cluster:
    rows.append(["a Call of 8,000,000 `none` values", many_nones(cluster)])
    rows.append(["a plain-iterable feed, a batch of 256 x 1 MiB rows into a 64 MiB arena",
                 huge_batch(cluster)])
    rows.append(["60 slow calls (12 s each) of one session, then a new controller",
                 slow_calls(cluster)])
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
  rows.append(["Handshake and Status without the token", unauthenticated()])
  with tempfile.TemporaryDirectory() as tmp:
    rows.append(["a save that fails with ENOSPC, then the next save", full_disk(tmp)])
  _print(args, rows)


def _print(args: argparse.Namespace, rows: list) -> None:
  print(f"\nattacks against {args.label} (SIDECAR_PEER_TIMEOUT="
        f"{os.environ.get('SIDECAR_PEER_TIMEOUT', 'unset')}; load average "
        f"{os.getloadavg()[0]:.1f})\n")
  print(table(["attack", "outcome"], rows))


if __name__ == "__main__":
  main()
