"""``sidecar status``: one table row per sidecar, read with the Status RPC."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc

from sidecar._src import protocol, shm
from sidecar._src.controller.connection import CHANNEL_OPTIONS
from sidecar._src.protocol import pb


def fetch(address: str, *, timeout: float, token: str | None = None) -> pb.StatusResponse:
  """One sidecar's status; needs no handshake, so it works across versions."""
  with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
    rpc = channel.unary_unary(f"/{protocol.SERVICE}/Status",
                              request_serializer=pb.StatusRequest.SerializeToString,
                              response_deserializer=pb.StatusResponse.FromString)
    meta = ((protocol.AUTH_KEY, f"Bearer {token}"),) if token else ()
    try:
      return rpc(pb.StatusRequest(), timeout=timeout, metadata=meta)
    except grpc.RpcError as e:
      raise protocol.error_from_rpc(e, host=address) from None


def format_table(rows: Sequence[tuple[str, pb.StatusResponse | Exception]]) -> str:
  header = ("ADDRESS", "HOST", "SLICE", "PROCESS", "DEVICES", "HOSTNAME", "PID", "ARENA USED/SIZE",
            "BLOCKS", "WORKERS", "CALLS", "UPTIME", "REGISTERED")
  lines = [header]
  for address, s in rows:
    if isinstance(s, Exception):
      lines.append((address, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                    f"UNREACHABLE: {s}".splitlines()[0]))
      continue
    ident = s.identity
    names = ", ".join(f"{e.name} ({e.kind})" for e in s.registry) or "(none)"
    process = str(ident.process_index) if ident.HasField("process_index") else "-"
    lines.append((address, str(ident.host_id), str(ident.slice_id), process,
                  ",".join(map(str, ident.device_ids)) or "-", ident.hostname, str(ident.pid),
                  f"{shm.format_size(s.arena_used)}/{shm.format_size(s.arena_size)}",
                  str(s.arena_blocks), str(s.workers), str(s.calls), f"{s.uptime_s:.0f}s", names))
  widths = [max(len(row[i]) for row in lines) for i in range(len(header) - 1)]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]
                   for row in lines)


def format_feeds(rows: Sequence[tuple[str, pb.StatusResponse | Exception]]) -> str:
  """One line per running feed: rates and where the time goes, per batch."""
  header = ("HOST", "PIPELINE", "WORKERS", "BATCHES", "BATCHES/S", "PRODUCE MS", "BACKPRESSURE MS",
            "TRAINER WAIT MS", "ARENA")
  lines = [header]
  for _, s in rows:
    if isinstance(s, Exception):
      continue
    for f in s.feeds:
      n = max(f.batches, 1)
      lines.append((str(s.identity.host_id), f.pipeline, str(f.workers), str(f.batches),
                    f"{f.batches / f.uptime_s:.1f}" if f.uptime_s else "-",
                    f"{f.produce_s / n * 1e3:.2f}", f"{f.backpressure_s / n * 1e3:.2f}",
                    f"{f.trainer_wait_s / n * 1e3:.2f}",
                    f"{s.arena_used / max(s.arena_size, 1):.0%}"))
  if len(lines) == 1:
    return "no feeds running"
  widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


def format_checkpoints(rows: Sequence[tuple[str, pb.StatusResponse | Exception]]) -> str:
  """One line per host and checkpoint directory: the steps each tier holds."""
  lines = []
  for _, s in rows:
    if isinstance(s, Exception):
      continue
    for c in s.checkpoints:
      writing = "none"
      if c.writing:
        rate = c.written_bytes / c.writing_s / 1e9 if c.writing_s else 0.0
        writing = (f"{list(c.writing)} ({shm.format_size(c.written_bytes)} of "
                   f"{shm.format_size(c.total_bytes)}, {rate:.2f} GB/s)")
      held = "; ".join(f"{list(r.steps)} of host {r.source_host} ({shm.format_size(r.nbytes)})"
                       for r in c.replicas) or "none"
      waiting = f"  staged, not committed: {list(c.uncommitted)}" if c.uncommitted else ""
      lines.append(f"host {s.identity.host_id}  {c.directory}  RAM tier: "
                   f"{list(c.ram_steps) or 'none'}  replicas: {held}  being written: {writing}"
                   f"{waiting}")
  return "\n".join(lines) if lines else "no checkpoints held"


def print_status(addresses: Sequence[str], *, timeout: float, token: str | None = None) -> int:
  """Prints the tables; returns 1 if any sidecar did not answer."""
  rows: list[tuple[str, pb.StatusResponse | Exception]] = []
  for a in addresses:
    try:
      rows.append((a, fetch(a, timeout=timeout, token=token)))
    except Exception as e:
      rows.append((a, e))
  print(format_table(rows), file=sys.stdout)
  print(file=sys.stdout)
  print(format_feeds(rows), file=sys.stdout)
  print(file=sys.stdout)
  print(format_checkpoints(rows), file=sys.stdout)
  return 1 if any(isinstance(s, Exception) for _, s in rows) else 0
