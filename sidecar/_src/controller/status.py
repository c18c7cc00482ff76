"""``sidecar status``: one table row per sidecar, read with the Status RPC.

Under it, a row per trainer attached (:func:`format_trainers`: its rank, process, steps,
its last step and the seconds since, the stall timeout in force, its phase and what that
makes it), then the feeds and the checkpoints. ``--json`` prints one object with every
host, for scripts; ``--watch`` redraws the tables every ``--interval`` seconds, with rates
measured between two refreshes.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import grpc
from google.protobuf import message as pb_message

from sidecar._src.arena import shm
from sidecar._src.controller import connection, display
from sidecar._src.controller.connection import CHANNEL_OPTIONS
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb


def fetch(address: str, *, timeout: float, token: str | None = None) -> pb.StatusResponse:
  """One sidecar's status (``address``: ``unix:PATH`` or ``HOST:PORT``); needs no
  handshake, so it works across versions. Over TLS where ``$SIDECAR_TLS_CA`` (and for mTLS
  ``$SIDECAR_TLS_CLIENT_CERT``/``_KEY``) say so."""
  credentials = protocol.tls_credentials(None, None, None)
  channel, pin = connection.open_channel(address, timeout=timeout, options=CHANNEL_OPTIONS,
                                         credentials=credentials)
  with channel, pin or contextlib.nullcontext():
    rpc = channel.unary_unary(f"/{protocol.SERVICE}/Status",
                              request_serializer=pb.StatusRequest.SerializeToString,
                              response_deserializer=pb.StatusResponse.FromString)
    meta = ((protocol.AUTH_KEY, f"Bearer {token}"),) if token else ()
    try:
      return rpc(pb.StatusRequest(), timeout=timeout, metadata=meta)
    except grpc.RpcError as e:
      raise (connection.not_a_sidecar(e, address)
             or protocol.error_from_rpc(e, host=address)) from None


Rows = Sequence[tuple[str, "pb.StatusResponse | Exception"]]


def fetch_all(addresses: Sequence[str], *, timeout: float, token: str | None = None
              ) -> list[tuple[str, pb.StatusResponse | Exception]]:
  """Every sidecar's status, or the error that kept it from answering."""
  rows: list[tuple[str, pb.StatusResponse | Exception]] = []
  for a in addresses:
    try:
      rows.append((a, fetch(a, timeout=timeout, token=token)))
    except Exception as e:
      rows.append((a, e))
  return rows


def to_dict(m: pb_message.Message) -> dict[str, Any]:
  """A message as plain JSON values: every field, 64-bit ints as numbers (not strings,
  as protobuf's JSON mapping has them), an unset optional field as None."""
  out: dict[str, Any] = {}
  for f in m.DESCRIPTOR.fields:
    v = getattr(m, f.name)
    if f.is_repeated:
      out[f.name] = [to_dict(x) if f.message_type else x for x in v]
    elif f.message_type:
      out[f.name] = to_dict(v)
    elif f.has_presence and not m.HasField(f.name):
      out[f.name] = None
    else:
      out[f.name] = v
  return out


def as_json(rows: Rows) -> dict[str, Any]:
  """One object with every host: ``{"time": ..., "hosts": [{"address", "ok", ...}]}``."""
  hosts = []
  for address, s in rows:
    if isinstance(s, Exception):
      hosts.append({"address": address, "ok": False, "error": f"{type(s).__name__}: {s}"})
    else:
      hosts.append({"address": address, "ok": True, **to_dict(s)})
  return {"time": time.time(), "hosts": hosts}


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
    # One process that owns every device declares no index (the sidecars' --device-ids
    # say whose devices are whose, or its trainer's are): its trainers' ranks say who.
    ranks = sorted({t.rank for t in s.trainers if not t.ended and t.rank >= 0})
    process = (str(ident.process_index) if ident.HasField("process_index") else
               "rank " + ",".join(map(str, ranks)) if ranks else "-")
    devices = ",".join(map(str, ident.device_ids)) or ("its trainer's" if ranks else "-")
    lines.append((address, str(ident.host_id), str(ident.slice_id), process,
                  devices, ident.hostname, str(ident.pid),
                  f"{shm.format_size(s.arena_used)}/{shm.format_size(s.arena_size)}",
                  str(s.arena_blocks), str(s.workers), str(s.calls), f"{s.uptime_s:.0f}s", names))
  widths = [max(len(row[i]) for row in lines) for i in range(len(header) - 1)]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]
                   for row in lines)


TRAINER_HEADER = ("HOST", "RANK", "PID", "RESTART", "STEPS", "LAST STEP", "SINCE",
                  "STALL TIMEOUT", "PHASE", "STATE")


def trainer_state(t: pb.TrainerStatus) -> str:
  """What a trainer's step signal makes it, in a word or three: ``ended``, ``STALLED``
  (no step for longer than its stall timeout), ``starting`` (before its first completed
  step: its start, a restore, its first compile are never timed), ``in phase NAME`` (a
  long phase it announced), ``stepping``; a gap past half its timeout says so."""
  if t.ended:
    return "ended"
  if t.stalled:
    return "STALLED"
  if t.since_step_s < 0:
    return "starting"
  if t.phase:
    return f"in phase {t.phase}"
  if t.stall_timeout_s > 0 and t.since_step_s > t.stall_timeout_s / 2:
    return f"no step for {100 * t.since_step_s / t.stall_timeout_s:.0f}% of its timeout"
  return "stepping"


def format_trainers(rows: Rows) -> str:
  """One line per trainer attached to each sidecar (and those ended in the last minute):
  its rank, process, restart, steps (batches its trainer took from the sidecar's feeds),
  the time of its last step and the seconds since, the stall timeout in
  force (its phase's budget included; "off": none), its phase and its state."""
  lines = [TRAINER_HEADER]
  for _, s in rows:
    if isinstance(s, Exception):
      continue
    for t in s.trainers:
      timed = t.since_step_s >= 0
      last = (time.strftime("%H:%M:%S", time.localtime(t.last_step_unix))
              if timed and t.last_step_unix > 0 else "-")
      phase = f"{t.phase} ({t.phase_s:.0f} s)" if t.phase else (
          "startup" if not timed and not t.ended else "-")
      lines.append((str(s.identity.host_id), str(t.rank) if t.rank >= 0 else "-",
                    str(t.pid) if t.pid_verified else f"{t.pid} (unverified)",
                    str(t.restart) if t.restart >= 0 else "-", str(t.steps), last,
                    f"{t.since_step_s:.1f} s" if timed else "-",
                    f"{t.stall_timeout_s:.0f} s" if t.stall_timeout_s > 0 else "off",
                    phase, trainer_state(t)))
  if len(lines) == 1:
    return "no trainers attached"
  widths = [max(len(row[i]) for row in lines) for i in range(len(TRAINER_HEADER))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


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


def format_tenants(rows: Rows) -> str:
  """One line per host and tenant of a pool (``sidecar serve --pool``); "" elsewhere."""
  table = display.tenant_rows([(s.identity.host_id, a, s) for a, s in rows
                               if not isinstance(s, Exception)])
  if not table:
    return ""
  lines = [[h.upper() for h in display.TENANT_HEADER], *table]
  widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


def format_checkpoints(rows: Rows, previous: Rows | None = None, seconds: float = 0.0) -> str:
  """One line per host and checkpoint directory: the steps each tier holds, and those
  being written with GB/s (between ``previous`` and ``rows``, ``seconds`` apart, when
  given; else since each write began)."""
  written_before = {}
  for address, s in previous or ():
    if not isinstance(s, Exception):
      for c in s.checkpoints:
        written_before[(address, c.directory, tuple(c.writing))] = c.written_bytes
  lines = []
  for address, s in rows:
    if isinstance(s, Exception):
      continue
    for c in s.checkpoints:
      writing = "none"
      if c.writing:
        old = written_before.get((address, c.directory, tuple(c.writing)))
        if old is not None and seconds > 0:
          rate = (c.written_bytes - old) / seconds / 1e9
        else:
          rate = c.written_bytes / c.writing_s / 1e9 if c.writing_s else 0.0
        writing = (f"{list(c.writing)} ({shm.format_size(c.written_bytes)} of "
                   f"{shm.format_size(c.total_bytes)}, {rate:.2f} GB/s)")
      held = "; ".join(f"{list(r.steps)} of host {r.source_host} ({shm.format_size(r.nbytes)})"
                       for r in c.replicas) or "none"
      waiting = (f"  committing (the sidecars'): {list(c.committing)}" if c.committing else ""
                 ) + (f"  staged, not committed: {list(c.uncommitted)}" if c.uncommitted else "")
      lines.append(f"host {s.identity.host_id}  {c.directory}  RAM tier: "
                   f"{list(c.ram_steps) or 'none'}  replicas: {held}  being written: {writing}"
                   f"{waiting}")
  return "\n".join(lines) if lines else "no checkpoints held"


def escape(text: str) -> str:
  """``text`` with its control characters (newlines, ESC, ...) written as escapes: a name
  that a client chose (a directory, a tenant, a client) never writes to a terminal."""
  if text.isprintable():
    return text
  return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                 for c in text)


def _escape_fields(m: pb_message.Message) -> None:
  """Escapes every string in ``m`` and the messages inside it, in place."""
  for field, value in m.ListFields():
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
      items = [(escape(k) if isinstance(k, str) else k, v) for k, v in value.items()]
      value.clear()
      for k, v in items:
        if isinstance(v, pb_message.Message):
          _escape_fields(v)
          value[k].CopyFrom(v)
        else:
          value[k] = escape(v) if isinstance(v, str) else v
    elif field.type == field.TYPE_STRING:
      if field.is_repeated:
        value[:] = [escape(v) for v in value]
      else:
        setattr(m, field.name, escape(value))
    elif field.type == field.TYPE_MESSAGE:
      for v in (value if field.is_repeated else [value]):
        _escape_fields(v)


def shown(rows: Rows) -> list[tuple[str, pb.StatusResponse | Exception]]:
  """``rows`` as a terminal may show them: each status's strings :func:`escape`-d (the
  JSON output needs none: ``json.dump`` escapes control characters itself)."""
  out: list[tuple[str, pb.StatusResponse | Exception]] = []
  for address, s in rows:
    if not isinstance(s, Exception):
      s = pb.StatusResponse.FromString(s.SerializeToString())
      _escape_fields(s)
    out.append((address, s))
  return out


def print_status(addresses: Sequence[str], *, timeout: float, token: str | None = None,
                 as_json_: bool = False) -> int:
  """Prints the tables (or, with ``as_json_``, one JSON object); returns 1 if any sidecar
  did not answer."""
  rows = fetch_all(addresses, timeout=timeout, token=token)
  if as_json_:
    json.dump(as_json(rows), sys.stdout)
    print(file=sys.stdout)
    return 1 if any(isinstance(s, Exception) for _, s in rows) else 0
  rows = shown(rows)
  print(format_table(rows), file=sys.stdout)
  print(file=sys.stdout)
  if tenants := format_tenants(rows):
    print(tenants, file=sys.stdout)
    print(file=sys.stdout)
  print(format_trainers(rows), file=sys.stdout)
  print(file=sys.stdout)
  print(format_feeds(rows), file=sys.stdout)
  print(file=sys.stdout)
  print(format_checkpoints(rows), file=sys.stdout)
  return 1 if any(isinstance(s, Exception) for _, s in rows) else 0


# ---- --watch ---------------------------------------------------------------


def _feed_keys(rows: Rows) -> dict[tuple[str, str, int], pb.FeedStatus]:
  """Each running feed by (address, pipeline, n-th of that pipeline on the host)."""
  out = {}
  for address, s in rows:
    if isinstance(s, Exception):
      continue
    seen: dict[str, int] = {}
    for f in s.feeds:
      n = seen[f.pipeline] = seen.get(f.pipeline, -1) + 1
      out[(address, f.pipeline, n)] = f
  return out


def format_live(rows: Rows, previous: Rows | None, seconds: float) -> str:
  """The watch screen: hosts, then feeds and writes with rates over the last ``seconds``."""
  lines = [format_table(rows), ""]
  if tenants := format_tenants(rows):
    lines += [tenants, ""]
  lines += [format_trainers(rows), ""]
  before = _feed_keys(previous or ())
  header = ("HOST", "PIPELINE", "BATCHES", "BATCHES/S", "PRODUCE MS", "BACKPRESSURE MS",
            "TRAINER WAIT MS")
  table = [header]
  host_ids = {a: str(s.identity.host_id) for a, s in rows if not isinstance(s, Exception)}
  for (address, pipeline, n_th), f in _feed_keys(rows).items():
    old = before.get((address, pipeline, n_th))
    if old is not None and f.batches >= old.batches and seconds > 0:  # since the last refresh
      n, dt = f.batches - old.batches, seconds
      wait = f.trainer_wait_s - old.trainer_wait_s
      produce, back = f.produce_s - old.produce_s, f.backpressure_s - old.backpressure_s
    else:  # new: since it started
      n, dt, wait = f.batches, f.uptime_s, f.trainer_wait_s
      produce, back = f.produce_s, f.backpressure_s
    per = max(n, 1)
    table.append((host_ids[address], pipeline, str(f.batches), f"{n / dt:.1f}" if dt > 0 else "-",
                  f"{produce / per * 1e3:.2f}", f"{back / per * 1e3:.2f}",
                  f"{wait / per * 1e3:.2f}"))
  if len(table) == 1:
    lines.append("no feeds running")
  else:
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
  lines += ["", format_checkpoints(rows, previous, seconds)]
  return "\n".join(lines)


def watch(addresses: Sequence[str], *, interval: float, timeout: float,
          token: str | None = None, out: TextIO | None = None,
          refreshes: int | None = None) -> int:
  """Redraws the status every ``interval`` seconds until Ctrl-C (then returns 0)."""
  return display.redraw(
      "sidecar status", lambda: shown(fetch_all(addresses, timeout=timeout, token=token)),
      format_live, interval=interval, out=out, refreshes=refreshes)
