"""Tier 2: a Controller given its tenant's token in code (``token=``) attaches its Workers
with it too: on a pool's sidecar, whose worker socket asks every Worker for its tenant's
token, with nothing in the environment (issue 37)."""

import numpy as np
import pytest

from sidecar._src.core import env as env_lib
from tests.support.pool_files import ALICE, controller, write_pool

pytestmark = pytest.mark.server


def test_an_explicit_token_reaches_the_controllers_worker(make_server, tmp_path, monkeypatch):
  for var in (env_lib.TOKEN, env_lib.TOKEN_FILE):
    monkeypatch.delenv(var, raising=False)
  server = make_server(pool=write_pool(tmp_path))
  with controller(server, ALICE, attach=True) as ctl:
    worker = ctl.worker(0)
    assert worker is not None  # attached: the pool took alice's token at attach
    assert ctl.call("echo", args=(np.arange(1 << 16),))[0].sum() == np.arange(1 << 16).sum()
    (row,) = ctl.status()[0].tenants  # its own row: its Worker counts as alice's
    assert (row.name, row.workers) == ("alice", 1)
