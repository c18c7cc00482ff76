"""A pool's ``ram_keep`` (read from a real pool file) and when Departures releases a
tenant's RAM-tier steps, on a clock the test moves."""

import os

import pytest

from sidecar._src.core import errors
from sidecar._src.server.pool import departures as departures_lib, pool_file
from sidecar._src.server.tenancy import tenants as tenants_lib

pytestmark = pytest.mark.unit


def _tenancy(tmp_path, text: str) -> tenants_lib.Tenancy:
  for name in ("alice", "bob"):
    (tmp_path / f"{name}.token").write_text(f"token-of-{name}\n")
    os.chmod(tmp_path / f"{name}.token", 0o600)
  path = tmp_path / "pool.yaml"
  path.write_text(text)
  os.chmod(path, 0o600)
  return tenants_lib.Tenancy(pool_file.load(str(path)))


@pytest.mark.parametrize("value, seconds", [("90", 90.0), ("1.5", 1.5), ("10m", 600.0),
                                            ("2h", 7200.0), ("0s", 0.0)],
                         ids=["int", "float", "minutes", "hours", "zero"])
def test_ram_keep_is_a_duration(tmp_path, value, seconds):
  tenancy = _tenancy(tmp_path, f"tenants:\n  - {{name: alice, token_file: alice.token, "
                     f"ram_keep: {value}}}\n  - {{name: bob, token_file: bob.token}}\n")
  assert [t.ram_keep for t in tenancy.pool.tenants] == [seconds, None]


@pytest.mark.parametrize("value", ["-1", "soon", "10x", "true"], ids=str)
def test_a_bad_ram_keep_is_refused_naming_its_line(tmp_path, value):
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:3: tenant 'bob': ram_keep is seconds >= 0 or a duration "
                     r"such as 90s, 10m or 2h, got"):
    _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token}\n"
             f"  - {{name: bob, token_file: bob.token, ram_keep: {value}}}\n")


def test_released_once_ram_keep_after_the_job_left_and_again_after_it_came_back(tmp_path):
  tenancy = _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                     "ram_keep: 10}\n  - {name: bob, token_file: bob.token}\n")
  now = [100.0]
  busy = {"alice": True, "bob": False}
  last_used: dict[str, float | None] = {"alice": 100.0, "bob": None}
  released: list[str] = []
  d = departures_lib.Departures(tenancy, busy=busy.__getitem__, last_used=last_used.__getitem__,
                            release=lambda name: released.append(name) or 3,
                            clock=lambda: now[0])
  assert d.tick() == []  # alice is there; bob has no ram_keep
  busy["alice"] = False  # her job left at 100
  now[0] = 105.0
  assert d.tick() == []
  last_used["alice"] = 106.0  # one of her sessions is used: still there
  now[0] = 112.0
  assert d.tick() == []
  now[0] = 116.5
  assert d.tick() == ["alice"] and released == ["alice"]
  now[0] = 200.0
  assert d.tick() == []  # once per departure
  busy["alice"] = True  # back, then gone again
  assert d.tick() == []
  busy["alice"] = False
  now[0] = 210.5
  assert d.tick() == ["alice"] and released == ["alice", "alice"]
  d.close()
