"""Tier 2: plain ``sidecar status`` and a Controller's repr on a pool's sidecar (issue 37):
a tenants table beside the hosts', a tenant's with its own row only, none for the pool's
peer token (the sidecars' own, no tenant: issue 42); nothing of it on a sidecar without a
pool."""

import io

import numpy as np
import pytest

from sidecar._src.arena.worker import Worker
from sidecar._src.controller import status as status_lib
from tests.conftest import PEER_TOKEN
from tests.support.pool_files import ALICE, BOB, controller, write_pool

pytestmark = pytest.mark.server


def _tenant_lines(text: str) -> dict[str, list[str]]:
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("HOST  TENANT"))
  rows = {}
  for line in lines[start + 1:]:
    if not line.strip():
      break
    cells = line.split()
    rows[cells[1]] = cells
  return rows


def test_status_shows_each_tenants_row(make_server, tmp_path, capsys):
  server = make_server(pool=write_pool(tmp_path))
  address = f"127.0.0.1:{server.port}"
  worker = Worker(server.options.socket_path, token=ALICE)
  try:
    block = worker.put(np.ones(1 << 20, np.uint8), timeout=10)
    with controller(server, ALICE) as ctl:
      assert status_lib.print_status([address], timeout=5, token=PEER_TOKEN) == 0
      assert "TENANT" not in capsys.readouterr().out  # the sidecars' token: no tenant's rows
      assert status_lib.print_status([address], timeout=5, token=ALICE) == 0
      rows = _tenant_lines(capsys.readouterr().out)
      assert set(rows) == {"alice"}
      # host, tenant, sessions, workers, arena held (guaranteed / ceiling), ...
      assert rows["alice"][:5] == ["0", "alice", "1", "1", "1.0"]
      # feeds, feed workers, batches, saves, RAM tier ("0 B (no quota)"), queue
      assert rows["alice"][-9:] == ["0", "0", "0", "0", "0", "B", "(no", "quota)", "0"]
      assert status_lib.print_status([address], timeout=5, token=BOB) == 0
      assert _tenant_lines(capsys.readouterr().out)["bob"][2:4] == ["0", "0"]
      shown = repr(ctl)  # the Controller's own view: its tenant's row
      assert "tenant" in shown and "alice" in shown and "bob" not in shown
      assert "<th style='text-align:left'>queue</th>" in ctl._repr_html_()
    del block
  finally:
    worker.close()


def test_no_tenants_table_without_a_pool(make_server, capsys):
  server = make_server()
  assert status_lib.print_status([f"127.0.0.1:{server.port}"], timeout=5,
                             token=server.options.token) == 0
  assert "TENANT" not in capsys.readouterr().out


def test_status_watch_redraws_the_hosts_and_feeds(make_server):
  server = make_server()
  out = io.StringIO()
  assert status_lib.watch([f"127.0.0.1:{server.port}"], interval=0.05, timeout=5, out=out,
                          refreshes=2) == 0
  screens = out.getvalue().split("sidecar status  ")[1:]
  assert len(screens) == 2
  assert all("(Ctrl-C to stop)\n\n" in s and "no feeds running" in s for s in screens)
