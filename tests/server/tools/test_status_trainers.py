"""Tier 2: what ``sidecar status``, ``sidecar stalls`` and ``sidecar goodput`` say of a
trainer while it steps, while it is in a phase it announced, and during a hang (issue 79
item 3): an in-process sidecar, this process its trainer, the commands run in-process."""

import json
import os
import re

import numpy as np
import pytest

import sidecar
from sidecar._src.controller import status as status_lib
from sidecar._src.core import stall
from sidecar._src.tools import cli
from tests.conftest import eventually

pytestmark = pytest.mark.server
TIMEOUT_S = 1.0  # the sidecar's stall timeout: the hang below passes it


def _row(out: str) -> list[str]:
  """The one trainer row of ``sidecar status``'s trainers table."""
  lines = out.splitlines()
  at = next(i for i, line in enumerate(lines) if line.startswith("HOST  RANK"))
  return re.split(r"\s{2,}", lines[at + 1].strip())


def test_status_stalls_and_goodput_show_a_trainer_stepping_in_a_phase_and_hung(
    make_server, tmp_path, capsys, monkeypatch):
  """Before: no row per trainer in `sidecar status` (only --json had since_step_s); it
  looked the same 5 s into a hang as while training; `sidecar stalls` said nothing before
  a timeout had passed; `sidecar goodput` counted a hang in progress as productive."""
  for name in ("SIDECAR_HOSTS", "SIDECAR_TOKEN", "SIDECAR_TOKEN_FILE"):
    monkeypatch.delenv(name, raising=False)
  server = make_server(stall_timeout_s=TIMEOUT_S)
  address = f"127.0.0.1:{server.port}"
  with sidecar.jax.Controller([address]) as ctl:
    ckpt = ctl.checkpointer(tmp_path / "ck")  # the job's ledger goes there
    ckpt.save(1, {"w": np.ones(8, np.float32)}).durable.result(60)
    with ctl.phase("eval", budget_s=600):  # its startup is over: its clock runs
      ctl.worker(0).tell(stall.Phase(stall.STARTUP))
      ctl.worker(0).check_alive()  # a request after the frames: both handled
      assert cli.main(["status", address]) == 0
      row = _row(capsys.readouterr().out)
      assert row[:4] == ["0", "-", str(os.getpid()), "-"], row  # host, rank, pid, restart
      assert row[6].endswith(" s") and row[7] == "600 s", row  # since its step; the budget
      assert re.fullmatch(r"eval \(\d+ s\)", row[8]) and row[9] == "in phase eval", row
      assert cli.main(["stalls", address]) == 0
      said = capsys.readouterr().out
      assert re.search(r"host 0 rank -1 not stalled: in phase eval, its last step [\d.]+ s "
                       r"ago, in it \d+ s \(its stall timeout 600.0 s\)", said), said
    # The phase ended: the trainer makes no step any more, a hang.
    ctl.worker(0).check_alive()
    assert eventually(lambda: status_lib.fetch(address, timeout=5).trainers[0].stalled,
                      timeout=30)
    assert cli.main(["status", address]) == 0
    row = _row(capsys.readouterr().out)
    assert row[7] == f"{TIMEOUT_S:.0f} s" and row[8:] == ["-", "STALLED"], row
    assert re.fullmatch(r"\d\d:\d\d:\d\d", row[5]), row  # its last step's time
    assert cli.main(["stalls", address]) == 1
    assert "host 0 rank -1 stalled: no step for" in capsys.readouterr().out
    # The ledger's file ends before the hang; its sidecar says the rest.
    assert cli.main(["goodput", str(tmp_path / "ck"), address, "--json"]) == 0
    captured = capsys.readouterr()
    account = json.loads(captured.out)
    assert account["badput_s"]["stall"] > 0, account
    assert re.search(r"sidecar goodput: life \d+@[\d.]+ is stalled: no step for [\d.]+ s, past "
                     r"its stall timeout of 1.0 s: counted as stall since its last step",
                     captured.err), captured.err
    ckpt.close()
