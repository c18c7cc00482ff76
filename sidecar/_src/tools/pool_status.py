"""``sidecar pool status``: a pool's tenants, one row each, summed over its sidecars.

Read with the Status RPC (``controller/status.fetch``), as ``sidecar status`` is: its
``tenants`` rows (``TenantStatus``). The pool's operator token (``operator_token_file`` in
the pool file, or ``sidecar serve --operator-token-file``; ``sidecar local --pool`` prints
its file) shows every tenant's row; a tenant's token that tenant's row only; the pool's
peer token, the sidecars' own, none. ``--json`` prints one object for scripts; ``--watch``
redraws the table every ``--interval`` seconds, batches/s measured between two refreshes.

Figures a sidecar does not report (an older one, or one whose ``TenantStatus`` lacks the
field) show as ``-`` in the table and ``null`` in JSON, never as 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from sidecar._src.tools import cli_format, cli_types

# TenantStatus fields read if the sidecar has them (None otherwise): feed batches made,
# saves in progress, requests waiting for admission, RAM-tier bytes and their quota.
OPTIONAL = ("batches", "saves", "waiting", "ram_tier_bytes", "ram_tier_quota")


@dataclasses.dataclass(frozen=True, slots=True)
class TenantRow:
  """One tenant over every sidecar that answered: sums, and the hosts it has work on."""
  tenant: str
  hosts: int  # sidecars where it holds a session, worker, block or feed
  sessions: int
  workers: int
  arena_bytes: int
  arena_guaranteed: int  # per sidecar, summed
  arena_ceiling: int
  feeds: int
  feed_workers: int
  weight: float
  batches: int | None
  saves: int | None
  waiting: int | None
  ram_tier_bytes: int | None
  ram_tier_quota: int | None  # per sidecar, summed; 0: none

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _optional(message: Any, name: str) -> int | None:
  """``message.name`` where its type has that field, else None (a sidecar of another
  version answers too: Status needs no handshake)."""
  if name not in message.DESCRIPTOR.fields_by_name:
    return None
  return int(getattr(message, name))


def _add(a: int | None, b: int | None) -> int | None:
  return None if a is None or b is None else a + b


def tenant_rows(statuses: Sequence[Any]) -> list[TenantRow]:
  """Each tenant's row, its figures summed over ``statuses`` (``pb.StatusResponse``s), in
  the order the pool file lists them."""
  rows: dict[str, TenantRow] = {}
  for status_lib in statuses:
    for t in status_lib.tenants:
      busy = int(bool(t.sessions or t.workers or t.arena_bytes or t.feeds))
      new = TenantRow(
          tenant=t.name, hosts=busy, sessions=t.sessions, workers=t.workers,
          arena_bytes=t.arena_bytes, arena_guaranteed=t.arena_guaranteed,
          arena_ceiling=t.arena_ceiling, feeds=t.feeds, feed_workers=t.feed_workers,
          weight=t.weight, **{f: _optional(t, f) for f in OPTIONAL})
      old = rows.get(t.name)
      if old is None:
        rows[t.name] = new
        continue
      sums: dict[str, Any] = {
          f.name: _add(getattr(old, f.name), getattr(new, f.name))
          for f in dataclasses.fields(TenantRow) if f.name not in ("tenant", "weight")}
      rows[t.name] = dataclasses.replace(old, **sums)
  return list(rows.values())


def format_table(rows: Sequence[TenantRow], previous: Sequence[TenantRow] | None = None,
                 seconds: float = 0.0, *, answered: bool = True) -> str:
  """The table; BATCHES/S from ``previous`` (the refresh ``seconds`` ago), else ``-``;
  ``answered``: whether any sidecar answered (else no row says nothing of a pool file)."""
  from sidecar._src.arena import shm
  fmt = shm.format_size
  before = {r.tenant: r for r in previous or ()}
  header = ("TENANT", "HOSTS", "SESSIONS", "WORKERS", "ARENA (GUARANTEED / CEILING)", "FEEDS",
            "FEED WORKERS", "BATCHES/S", "SAVES", "RAM TIER (QUOTA)", "QUEUE")
  table = [header]
  for r in rows:
    old = before.get(r.tenant)
    rate = "-"
    if (old is not None and seconds > 0 and r.batches is not None and old.batches is not None
        and r.batches >= old.batches):
      rate = f"{(r.batches - old.batches) / seconds:.1f}"
    table.append((
        r.tenant or "<shared>", str(r.hosts), str(r.sessions), str(r.workers),
        f"{fmt(r.arena_bytes)} ({fmt(r.arena_guaranteed)} / {fmt(r.arena_ceiling)})",
        str(r.feeds), str(r.feed_workers), rate, _text(r.saves), _ram_tier(r),
        _text(r.waiting)))
  if len(table) == 1 and not answered:
    return "no tenants shown: no sidecar answered"
  if len(table) == 1:
    return ("no tenants: the sidecars have no pool file (sidecar serve --pool), or this "
            "token's tenant is not in it")
  widths = [max(len(row[i]) for row in table) for i in range(len(header))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


def _text(n: int | None) -> str:
  return "-" if n is None else str(n)


def _ram_tier(r: TenantRow) -> str:
  from sidecar._src.arena import shm
  if r.ram_tier_bytes is None:
    return "-"
  quota = shm.format_size(r.ram_tier_quota) if r.ram_tier_quota else "no quota"
  return f"{shm.format_size(r.ram_tier_bytes)} ({quota})"


def _unreachable(answers: Sequence[tuple[str, Any]]) -> list[str]:
  """``ADDR: ErrorType: message`` of each sidecar that did not answer."""
  out = []
  for address, s in answers:
    if isinstance(s, Exception):
      text, kind = str(s), type(s).__name__
      out.append(f"{address}: {text if text.startswith(kind) else f'{kind}: {text}'}")
  return out


def _fetch(addresses: Sequence[str], timeout: float, token: str | None, *,
           shown: bool = True) -> tuple[list[TenantRow], list[str], bool]:
  """The tenants' rows, the sidecars that did not answer, and whether any did;
  ``shown``: names escaped for a terminal (``status.shown``)."""
  from sidecar._src.controller import status as status_lib
  answers = status_lib.fetch_all(addresses, timeout=timeout, token=token)
  if shown:
    answers = status_lib.shown(answers)
  statuses = [s for _, s in answers if not isinstance(s, Exception)]
  return tenant_rows(statuses), _unreachable(answers), bool(statuses)


def print_status(addresses: Sequence[str], *, timeout: float, token: str | None,
                 as_json: bool = False, out: TextIO | None = None) -> int:
  """Prints the table (or one JSON object); returns 1 if any sidecar did not answer."""
  out = out or sys.stdout
  rows, unreachable, answered = _fetch(addresses, timeout, token, shown=not as_json)
  if as_json:
    json.dump({"tenants": [r.to_dict() for r in rows], "unreachable": unreachable}, out)
    out.write("\n")
  else:
    out.write(format_table(rows, answered=answered) + "\n")
    for line in unreachable:
      out.write(f"unreachable: {line}\n")
  return 1 if unreachable else 0


def watch(addresses: Sequence[str], *, interval: float, timeout: float, token: str | None,
          out: TextIO | None = None, refreshes: int | None = None) -> int:
  """Redraws the table every ``interval`` seconds until Ctrl-C (then returns 0)."""
  Fetched = tuple[list[TenantRow], list[str], bool]

  def screen(fetched: Fetched, previous: Fetched | None, seconds: float) -> str:
    rows, unreachable, answered = fetched
    return (format_table(rows, previous[0] if previous else None, seconds, answered=answered)
            + "".join(f"\nunreachable: {line}" for line in unreachable))
  from sidecar._src.controller import display  # grpc: loaded by the command that runs
  return display.redraw("sidecar pool status", lambda: _fetch(addresses, timeout, token),
                        screen, interval=interval, out=out, refreshes=refreshes)


def _run(args: argparse.Namespace) -> int:
  addresses = cli_types.addresses(args)
  if args.watch and args.json:
    args.parser.error("--watch and --json do not go together: pick one")
  if args.interval <= 0:
    args.parser.error(f"--interval must be a positive number of seconds, got {args.interval}")
  token = cli_types.token(args)
  if args.watch:
    return watch(addresses, interval=args.interval, timeout=args.timeout, token=token)
  return print_status(addresses, timeout=args.timeout, token=token, as_json=args.json)


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``pool status`` to ``subparsers`` (``sidecar``'s commands)."""
  pool = subparsers.add_parser("pool", help="a shared pool of sidecars (sidecar serve --pool)",
                               description="Look at a pool of sidecars that several tenants "
                                           "share (docs/pool.md).",
                               formatter_class=cli_format.DefaultsFormatter)
  commands = pool.add_subparsers(dest="pool_command", metavar="{status}")
  commands.required = True
  s = commands.add_parser(
      "status", help="each tenant's sessions, arena, feeds, batches/s, saves and queue",
      formatter_class=cli_format.DefaultsFormatter,
      description="Ask each sidecar of the pool for its tenants' use, with the token of "
                  "--token-file, $SIDECAR_TOKEN or $SIDECAR_TOKEN_FILE: a tenant's token "
                  "shows its own row, the pool's operator token every tenant's. Exit "
                  "status 1 if any sidecar is unreachable.")
  cli_types.add_status_flags(
      s, json_help="print one JSON object, for scripts (default: a table)",
      watch_help="redraw the table every --interval seconds, with batches/s, until Ctrl-C "
                 "(default: print once)")
  s.set_defaults(func=_run, parser=s)
