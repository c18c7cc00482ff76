"""A pool's quotas, one policy object each (server/tenancy/quotas.py): every quota of
``quotas.ALL`` reads from a pool file by its key with no other change, is refused below its
least naming the line, and resolves to a limit a part enforces (``Count.limit``, ``Held``).

Tier 1: pool files in a temporary directory, no server.
"""

import os

import pytest

from sidecar._src.core import errors
from sidecar._src.server.pool import pool_file
from sidecar._src.server.tenancy import quotas as quotas_lib, tenants as tenants_lib

pytestmark = pytest.mark.unit


def _load(tmp_path, extra: str = "", other: str = ""):
  for name in ("alice", "bob"):
    (tmp_path / f"{name}.token").write_text(f"token-of-{name}\n")
    os.chmod(tmp_path / f"{name}.token", 0o600)
  path = tmp_path / "pool.yaml"
  path.write_text("tenants:\n"
                  f"  - {{name: alice, token_file: alice.token{extra}}}\n"
                  f"  - {{name: bob, token_file: bob.token{other}}}\n")
  os.chmod(path, 0o600)
  return pool_file.load(str(path))


def _good(q: quotas_lib.Quota) -> tuple[str, object]:
  """A value the pool file may give ``q``, and what it reads as."""
  if isinstance(q, quotas_lib.Count):
    return str(q.least + 2), q.least + 2
  if isinstance(q, quotas_lib.Size):
    return "4GiB", 4 << 30
  if isinstance(q, quotas_lib.ArenaShare):
    return "0.25", quotas_lib.Share(fraction=0.25)
  return "90s", 90.0


def _bad(q: quotas_lib.Quota) -> str:
  """A value below ``q``'s least, or of the wrong kind."""
  if isinstance(q, quotas_lib.Count):
    return str(q.least - 1)
  if isinstance(q, quotas_lib.Size):
    return "512"  # bytes: below every size's least
  if isinstance(q, quotas_lib.ArenaShare):
    return "lots"
  return "soon"


@pytest.mark.parametrize("quota", quotas_lib.ALL, ids=lambda q: q.key)
def test_every_quota_reads_from_the_pool_file_by_its_key(tmp_path, quota):
  text, value = _good(quota)
  alice, bob = _load(tmp_path, f", {quota.key}: {text}").tenants
  assert alice.quotas == {quota.key: value} and quota.of(alice) == value
  assert getattr(alice, quota.key) == value  # the parts outside the package read it so
  assert quota.of(bob) == quota.default and bob.quotas == {}


@pytest.mark.parametrize("quota", quotas_lib.ALL, ids=lambda q: q.key)
def test_every_quota_below_its_least_is_refused_naming_its_line(tmp_path, quota):
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"pool.yaml:2: tenant 'alice': {quota.key} .*got"):
    _load(tmp_path, f", {quota.key}: {_bad(quota)}")


def test_a_quota_no_key_names_is_no_attribute(tmp_path):
  alice, _ = _load(tmp_path).tenants
  with pytest.raises(AttributeError, match="bananas"):
    alice.bananas  # noqa: B018


def test_a_count_left_out_is_a_share_by_weight_of_the_total_with_a_pool_file(tmp_path):
  pool = _load(tmp_path, ", calls: 3", ", weight: 3")
  alice, bob = pool.tenants
  assert quotas_lib.CALLS.limit(alice, pool, total=40) == quotas_lib.Limit(
      3, f"calls=3, {pool.path}:2")
  assert quotas_lib.CALLS.limit(bob, pool, total=40) == quotas_lib.Limit(
      30, f"its share by weight of 40, {pool.path}:3")
  assert quotas_lib.SESSIONS.limit(bob, pool, total=40).why.startswith(
      "its share by weight of max_sessions=40")
  assert quotas_lib.FEEDS.limit(bob, pool, total=40) is None  # no share: no bound


def test_held_refuses_a_tenant_past_its_count_and_never_another(tmp_path):
  pool = _load(tmp_path, ", feeds: 2")
  alice, bob = pool.tenants
  held = quotas_lib.Held(quotas_lib.FEEDS, "feeds", lambda: pool, fix="close some")
  with held.hold(alice), held.hold(alice):
    with pytest.raises(errors.ResourceExhaustedError,
                       match=r"tenant 'alice' holds 2 feeds; 1 more would pass its quota "
                       r"\(feeds=2, .*pool.yaml:2\); close some"):
      with held.hold(alice):
        pass
    with held.hold(bob, 16), held.hold(None, 99):  # bob has no quota; None is nobody's
      assert held.counts() == {"alice": 2, "bob": 16}
  assert held.counts() == {"alice": 0, "bob": 0}


def test_the_arena_parts_are_checked_against_the_arena(tmp_path):
  pool = _load(tmp_path, ", ram_tier: 2GiB")
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"tenant 'alice': ram_tier 2.0 GiB is more than the whole arena "
                     r"\(1.0 GiB, --shm-size\), which holds the RAM tier; lower it"):
    pool.check_arena(1 << 30)
  assert quotas_lib.ARENA_SHARES == (quotas_lib.ARENA, quotas_lib.ARENA_CEILING,
                                    quotas_lib.RAM_TIER)


def test_open_files_reach_a_tenants_data_roots_its_quota_or_its_share(tmp_path):
  """What a tenant's pipelines may hold open (issue 70, item 3): its open_files, else its
  share by weight of half the sidecar's descriptor limit; the feed's DataRoots carry it."""
  import resource
  pool = _load(tmp_path, ", open_files: 40", ", weight: 3")
  alice, bob = pool.data_roots("alice"), pool.data_roots("bob")
  assert (alice.open_files, alice.open_files_why) == (40, f"open_files=40, {pool.path}:2")
  half = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2
  assert bob.open_files == max(1, half * 3 // 4)
  assert bob.open_files_why == (f"its share by weight of open files (half the sidecar's "
                                f"RLIMIT_NOFILE)={half}, {pool.path}:3")


def test_feed_workers_memory_and_processes_have_defaults_in_a_pool_file_only(tmp_path):
  alice, bob = _load(tmp_path, ", feed_workers: 3").tenants
  pool = _load(tmp_path)
  assert quotas_lib.FEED_WORKERS.limit(alice, pool).most == 3
  default = quotas_lib.FEED_WORKERS.limit(bob, pool)
  assert default.most == quotas_lib.CPUS and "feed_workers=" in default.why
  assert "its default" in default.why and "pool.yaml:3" in default.why
  assert quotas_lib.MEMORY.limit(bob, pool).most == 4 << 30
  assert quotas_lib.PROCESSES.limit(bob, pool).most == 512
  shared = tenants_lib.Pool.clients((("alice", "a-token"),))  # no pool file: no default
  assert quotas_lib.FEED_WORKERS.limit(shared.tenants[0], shared) is None
  assert quotas_lib.MEMORY.limit(shared.tenants[0], shared) is None


def test_tmp_bytes_left_out_is_a_share_by_weight_of_the_total(tmp_path):
  alice, bob = _load(tmp_path, ", weight: 3").tenants
  pool = _load(tmp_path, ", weight: 3")
  mine = quotas_lib.TMP_BYTES.limit(alice, pool)
  assert mine.most == quotas_lib.TMP_TOTAL * 3 // 4
  assert "its share by weight of 128.0 MiB" in mine.why and "pool.yaml:2" in mine.why
  assert quotas_lib.TMP_BYTES.limit(bob, pool).most == quotas_lib.TMP_TOTAL // 4
  alice, _ = _load(tmp_path, ", tmp_bytes: 2MiB").tenants
  assert quotas_lib.TMP_BYTES.limit(alice, _load(tmp_path, ", tmp_bytes: 2MiB")).most == 2 << 20
