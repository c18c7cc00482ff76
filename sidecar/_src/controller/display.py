"""What a Controller, a Feed and a Checkpointer show in a notebook and at a prompt.

``__repr__`` is plain text, ``_repr_html_`` a small table. Both read one Status of
every live host, all at once and within :data:`STATUS_TIMEOUT_S` (a host that does
not answer shows as such); a feed's own figures need no call at all.
"""

from __future__ import annotations

import html
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO, TypeVar

import grpc

from sidecar._src.arena import shm
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb

STATUS_TIMEOUT_S = 1.0
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen

Row = tuple[int, str, "pb.StatusResponse | Exception"]  # host id, address, status or error


def host_rows(rows: Sequence[Row]) -> list[list[str]]:
  """Host, address, arena use, workers, running feeds, checkpoint tiers: one row a host."""
  out = []
  for host, address, s in rows:
    if isinstance(s, Exception):
      out.append([str(host), address, "unreachable: " + str(s).splitlines()[0][:120], "", "",
                  ""])
      continue
    arena = (f"{shm.format_size(s.arena_used)} / {shm.format_size(s.arena_size)} "
             f"({s.arena_used / max(s.arena_size, 1):.0%}), {s.arena_blocks} blocks")
    out.append([str(host), address, arena, str(s.workers), feeds_text(s.feeds),
                checkpoints_text(s.checkpoints)])
  return out


HOST_HEADER = ["host", "address", "arena", "workers", "feeds", "checkpoints"]
TENANT_HEADER = ["host", "tenant", "sessions", "workers", "arena (guaranteed / ceiling)",
                 "feeds", "feed workers", "batches", "saves", "ram tier (quota)", "queue"]


def tenant_rows(rows: Sequence[Row]) -> list[list[str]]:
  """One row per host and tenant of a pool's sidecars (``sidecar serve --pool``): the
  tenant's own row for its token; none elsewhere (the pool's peer token is no tenant's)."""
  out = []
  for host, _, s in rows:
    if isinstance(s, Exception):
      continue
    for t in s.tenants:
      arena = (f"{shm.format_size(t.arena_bytes)} ({shm.format_size(t.arena_guaranteed)} / "
               f"{shm.format_size(t.arena_ceiling)})")
      ram_tier = (f"{shm.format_size(t.ram_tier_bytes)} ("
                  f"{shm.format_size(t.ram_tier_quota) if t.ram_tier_quota else 'no quota'})")
      out.append([str(host), t.name, str(t.sessions), str(t.workers), arena, str(t.feeds),
                  str(t.feed_workers), str(t.batches), str(t.saves), ram_tier, str(t.waiting)])
  return out


def status_rows(statuses: Iterable[tuple[int, Any, Any]]) -> list[Row]:
  """``(host id, address, Status or error)`` of each ``(host id, connection, Status or
  RpcError)``, an RPC's failure made this package's error."""
  rows: list[Row] = []
  for h, c, s in statuses:
    if isinstance(s, grpc.RpcError):
      s = protocol.error_from_rpc(s, host=c.address, host_id=h)
    rows.append((h, c.address, s))
  return rows


def controller_facts(*, state: str, live: int, lost: dict[int, str], process: int,
                     processes: int, local_hosts: Sequence[int], feeds: Sequence[str],
                     checkpointers: Sequence[str]) -> list[tuple[str, str]]:
  """What a Controller shows above its hosts' table."""
  return [("state", state),
          ("hosts", f"{live} live" + (f", lost: {lost}" if lost else "")),
          ("this process", f"{process} of {processes}, drives hosts {list(local_hosts)}"),
          ("feeds open", ", ".join(repr(f) for f in feeds) or "none"),
          ("checkpointers", ", ".join(checkpointers) or "none")]


def hosts_block(title: str, facts: Sequence[tuple[str, str]], rows: Sequence[Row], *,
                as_html: bool) -> str:
  """``facts``, then a table of one row a host (none without ``rows``), as text or HTML."""
  tenants = tenant_rows(rows)
  if as_html:
    table = html_table(HOST_HEADER, host_rows(rows)) if rows else ""
    return html_block(title, facts, table + (html_table(TENANT_HEADER, tenants) if tenants
                                             else ""))
  table = text_table(HOST_HEADER, host_rows(rows)) if rows else ""
  if tenants:
    table += "\n" + text_table(TENANT_HEADER, tenants)
  return text_block(title, facts, table)


def feeds_text(feeds: Sequence[pb.FeedStatus]) -> str:
  parts = []
  for f in feeds:
    rate = f"{f.batches / f.uptime_s:.1f}/s" if f.uptime_s else "-"
    wait = f"{f.trainer_wait_s / max(f.batches, 1) * 1e3:.1f} ms"
    parts.append(f"{f.pipeline}: {f.batches} batches, {rate}, trainer wait {wait}")
  return "; ".join(parts) or "-"


def checkpoints_text(checkpoints: Sequence[pb.CheckpointStatus]) -> str:
  parts = []
  for c in checkpoints:
    text = f"{c.directory}: RAM {list(c.ram_steps) or '-'}"
    if c.replicas:
      text += ", replicas " + ", ".join(f"{list(r.steps)} of host {r.source_host}"
                                        for r in c.replicas)
    if c.writing:
      text += (f", writing {list(c.writing)} ({shm.format_size(c.written_bytes)} of "
               f"{shm.format_size(c.total_bytes)})")
    parts.append(text)
  return "; ".join(parts) or "-"


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
  lines = [list(header), *map(list, rows)]
  widths = [max(len(r[i]) for r in lines) for i in range(len(header) - 1)]
  return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]
                   for r in lines)


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in header)
  body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>"
                                  for c in r) + "</tr>" for r in rows)
  return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_block(title: str, facts: Sequence[tuple[str, str]], table: str = "") -> str:
  items = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in facts)
  return (f"<div><b>{html.escape(title)}</b><ul style='margin:0'>{items}</ul>{table}</div>")


def text_block(title: str, facts: Sequence[tuple[str, str]], table: str = "") -> str:
  lines = [title] + [f"  {k}: {v}" for k, v in facts]
  return "\n".join(lines + ([table] if table else []))


def feed_facts(stats: dict[str, Any], state: dict[str, Any], status: str) -> list[tuple[str, str]]:
  """A feed's own figures (no call): batches, rate, the trainer's wait, its position."""
  where = (f"epoch {state.get('epoch')}, position {state.get('position')}"
           if state.get("kind") == "map" else
           "; ".join(f"shard {i}: epoch {s['epoch']}, position {s['position']}"
                     for i, s in enumerate(state.get("shards", []))) or "start")
  return [("status", status), ("hosts", str(stats["hosts"])),
          ("batches", f"{stats['batches']} ({stats['batches_per_s']:.1f}/s)"),
          ("trainer wait", f"{stats['wait_s_mean'] * 1e3:.2f} ms/step mean, "
                           f"{stats['wait_s_p50'] * 1e3:.2f} p50, "
                           f"{stats['wait_s_max'] * 1e3:.2f} max"),
          ("position", where)]


def error_text(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


TIER_HEADER = ["host", "RAM tier", "replicas held", "being written", "staged, not committed"]


def tier_rows(statuses: Sequence[pb.StatusResponse], directory: str) -> list[list[str]]:
  """One row a host: the steps of ``directory`` in each of its tiers."""
  rows = []
  for s in statuses:
    for c in s.checkpoints:
      if c.directory != directory:
        continue
      writing = "-"
      if c.writing:
        rate = c.written_bytes / c.writing_s / 1e9 if c.writing_s else 0.0
        writing = (f"{list(c.writing)}: {shm.format_size(c.written_bytes)} of "
                   f"{shm.format_size(c.total_bytes)} ({rate:.2f} GB/s)")
      replicas = "; ".join(f"{list(r.steps)} of host {r.source_host}" for r in c.replicas)
      rows.append([str(s.identity.host_id), str(list(c.ram_steps) or "-"), replicas or "-",
                   writing, str(list(c.uncommitted) or "-")])
  return rows


def tier_table(status: Callable[[], Sequence[pb.StatusResponse]], directory: str, *,
               as_html: bool = False) -> str:
  """:func:`tier_rows` of one bounded Status (``status``) as a table; where it fails, one
  row that says why (a display never raises)."""
  try:
    rows = tier_rows(status(), directory)
  except Exception as e:  # a display never raises
    rows = [["-", error_text(e), "", "", ""]]
  return (html_table if as_html else text_table)(TIER_HEADER, rows)


def save_progress(statuses: Sequence[pb.StatusResponse], directory: str, step: int
                  ) -> str | None:
  """How much of ``step`` of ``directory`` is durable (``Checkpointer.wait``'s progress
  line); None until a sidecar has begun writing it."""
  done = total = 0
  seconds = 0.0
  for s in statuses:
    for c in s.checkpoints:
      if c.directory == directory and step in c.writing:
        done, total = done + c.written_bytes, total + c.total_bytes
        seconds = max(seconds, c.writing_s)
  if not total:
    return None
  rate = done / seconds / 1e9 if seconds else 0.0
  return (f"saving step {step}: {shm.format_size(done)} of {shm.format_size(total)} "
          f"durable ({rate:.2f} GB/s)")


def _future_state(f: Any) -> str:
  if not f.done():
    return "pending"
  return "failed" if f.exception() is not None else "done"


def checkpointer_facts(directory: str, steps: Sequence[int], in_flight: Any, last_restore: Any,
                       closed: bool) -> list[tuple[str, str]]:
  """A checkpointer's own figures (no call): steps, the save in flight, the last restore."""
  save = "none"
  if in_flight is not None:
    save = (f"step {in_flight.step}: staged {_future_state(in_flight.staged)}, durable "
            f"{_future_state(in_flight.durable)}, replicated "
            f"{_future_state(in_flight.replicated)}")
  return [("directory", directory), ("state", "closed" if closed else "open"),
          ("committed steps", str(list(steps)) if steps else "none"),
          ("latest save", save),
          ("last restore", last_restore.summary() if last_restore is not None else "none")]


Fetched = TypeVar("Fetched")


def redraw(title: str, fetch: Callable[[], Fetched],
           screen: Callable[[Fetched, Fetched | None, float], str], *, interval: float,
           out: TextIO | None = None, refreshes: int | None = None) -> int:
  """A ``--watch`` loop: every ``interval`` seconds, ``fetch()`` and write ``title`` over
  ``screen(fetched, the previous fetch (None at first), seconds since it)``, the terminal
  cleared first where ``out`` is one; until Ctrl-C (then returns 0), or ``refreshes``
  screens."""
  out = out or sys.stdout
  clear = CLEAR if out.isatty() else ""
  previous: Fetched | None = None
  last, n = time.monotonic(), 0
  try:
    while refreshes is None or n < refreshes:
      fetched = fetch()
      now = time.monotonic()
      out.write(f"{clear}{title}  {time.strftime('%H:%M:%S')}  every {interval:g} s  "
                "(Ctrl-C to stop)\n\n" + screen(fetched, previous, now - last) + "\n\n")
      out.flush()
      previous, last, n = fetched, now, n + 1
      time.sleep(max(0.0, interval - (time.monotonic() - now)))
  except KeyboardInterrupt:
    pass
  return 0
