"""Tier 1: ``sidecar pool status``'s rows and table from Status answers (issue 37)."""

import argparse
import json

import pytest

from sidecar._src.tools import pool_status
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


def answer(*tenants: pb.TenantStatus) -> pb.StatusResponse:
  return pb.StatusResponse(tenants=list(tenants))


ALICE = dict(name="alice", arena_guaranteed=4 << 20, arena_ceiling=8 << 20, weight=1.0)
BOB = dict(name="bob", arena_guaranteed=2 << 20, arena_ceiling=16 << 20, weight=2.0)


def test_a_tenant_is_summed_over_the_pools_sidecars():
  rows = pool_status.tenant_rows([
      answer(pb.TenantStatus(**ALICE, sessions=2, workers=1, arena_bytes=1 << 20, feeds=1,
                             feed_workers=4), pb.TenantStatus(**BOB)),
      answer(pb.TenantStatus(**ALICE, sessions=1, arena_bytes=3 << 20),
             pb.TenantStatus(**BOB))])
  alice, bob = rows
  assert (alice.tenant, alice.hosts, alice.sessions, alice.workers, alice.arena_bytes,
          alice.feeds, alice.feed_workers) == ("alice", 2, 3, 1, 4 << 20, 1, 4)
  assert alice.arena_guaranteed == 8 << 20  # 4 MiB on each of two sidecars
  assert (bob.tenant, bob.hosts, bob.sessions, bob.weight) == ("bob", 0, 0, 2.0)


def test_the_table_names_every_tenant_and_what_its_sidecars_do_not_report():
  rows = pool_status.tenant_rows([answer(pb.TenantStatus(**ALICE, sessions=2,
                                                         arena_bytes=1 << 20))])
  table = pool_status.format_table(rows)
  header, line = table.splitlines()
  assert header.split()[:4] == ["TENANT", "HOSTS", "SESSIONS", "WORKERS"]
  assert line.split()[:4] == ["alice", "1", "2", "0"]
  assert "1.0 MiB (4.0 MiB / 8.0 MiB)" in line
  fields = {f for f in pool_status.OPTIONAL if f in pb.TenantStatus.DESCRIPTOR.fields_by_name}
  if not fields:  # a sidecar without them: '-', never a made-up 0
    assert line.split()[-3:] == ["-", "-", "-"]


def test_no_pool_says_why_the_table_is_empty():
  assert pool_status.format_table(pool_status.tenant_rows([answer()])).startswith(
      "no tenants: the sidecars have no pool file (sidecar serve --pool)")


def test_the_command_registers_under_pool_and_refuses_watch_with_json(capsys):
  parser = argparse.ArgumentParser(prog="sidecar")
  pool_status.register(parser.add_subparsers(dest="command"))
  args = parser.parse_args(["pool", "status", "127.0.0.1:1", "--json", "--watch"])
  assert args.func is pool_status._run and args.pool_command == "status"
  with pytest.raises(SystemExit):
    args.func(args)
  assert "--watch and --json do not go together" in capsys.readouterr().err
  json.dumps(pool_status.TenantRow("a", 0, 0, 0, 0, 0, 0, 0, 0, 1.0, None, None, None, None,
                                   None).to_dict())


def test_the_ram_tier_is_summed_against_its_quota_or_says_there_is_none():
  rows = pool_status.tenant_rows([
      answer(pb.TenantStatus(**ALICE, ram_tier_bytes=3 << 20, ram_tier_quota=4 << 20, saves=1),
             pb.TenantStatus(**BOB, ram_tier_bytes=1 << 20)),
      answer(pb.TenantStatus(**ALICE, ram_tier_bytes=1 << 20, ram_tier_quota=4 << 20),
             pb.TenantStatus(**BOB))])
  alice, bob = rows
  assert (alice.ram_tier_bytes, alice.ram_tier_quota, alice.saves) == (4 << 20, 8 << 20, 1)
  table = pool_status.format_table(rows).splitlines()
  assert "RAM TIER (QUOTA)" in table[0]
  assert "4.0 MiB (8.0 MiB)" in table[1] and "1.0 MiB (no quota)" in table[2]


def test_no_answer_says_so_not_that_there_is_no_pool_file():
  assert pool_status.format_table([], answered=False) == "no tenants shown: no sidecar answered"
