"""Isolation, round 5, attack 6 (issue 54): names a client chose reach an operator's
terminal escaped. Before (26bb3d2), a directory named ``bob-x\\n<a forged line>`` printed a
line of bob's choosing in ``sidecar status``, and one with ESC sequences retitled, cleared
and coloured the operator's terminal."""

import json

import numpy as np
import pytest

import sidecar
from sidecar._src.tools import cli

pytestmark = pytest.mark.processes

FORGED = "bob-x\nhost 0  /etc  RAM tier: [7] (forged)"
ESCAPES = "bob-\x1b]2;pwned\x07\x1b[2J\x1b[31mALERT"


@pytest.mark.timeout(180)
def test_status_escapes_the_control_characters_of_client_chosen_names(tmp_path, capsys):
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1,
                                    checkpoint_roots=[str(tmp_path)]) as cluster:
    with cluster.controller() as ctl:
      for name in (FORGED, ESCAPES):
        ckpt = ctl.checkpointer(str(tmp_path / name))
        ckpt.save(0, {"x": np.arange(4.0)})
        ckpt.close()
      capsys.readouterr()
      assert cli.main(["status", *cluster.addresses]) == 0
      text = capsys.readouterr().out
      assert "\x1b" not in text and "\x07" not in text
      assert "(forged)" in text  # the name is shown, on the line of its directory
      assert not any(line.startswith("host 0  /etc") for line in text.splitlines())
      assert "bob-x\\nhost 0  /etc" in text
      assert "bob-\\x1b]2;pwned\\x07\\x1b[2J" in text
      # JSON carries the names as they are (json escapes them itself).
      assert cli.main(["status", "--json", *cluster.addresses]) == 0
      raw = capsys.readouterr().out
      assert "\x1b" not in raw
      dirs = [c["directory"] for h in json.loads(raw)["hosts"] for c in h["checkpoints"]]
      assert any(d.endswith(FORGED) for d in dirs) and any(d.endswith(ESCAPES) for d in dirs)
