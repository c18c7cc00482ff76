"""The pool file: each mistake refused naming its line; the tenants' quotas at run time.

Real files in tmp_path; the budgets (Sessions, Slots, InlineBytes, Leases) are the real
ones over a real allocator, with no sockets.
"""

import contextlib
import logging
import os
import threading

import pytest

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.limits import CallSlots, CheckpointSlots, InlineBytes, Sessions
from sidecar._src.server.pool import pool_file
from sidecar._src.server.tenancy import quotas as quotas_lib, tenants as tenants_lib

pytestmark = pytest.mark.unit

MiB = 1 << 20


def _tokens(tmp_path, *names):
  for name in names:
    path = tmp_path / f"{name}.token"
    path.write_text(f"token-of-{name}\n")
    os.chmod(path, 0o600)


def _pool(tmp_path, text: str, *names: str) -> str:
  _tokens(tmp_path, *(names or ("alice", "bob")))
  path = tmp_path / "pool.yaml"
  path.write_text(text)
  os.chmod(path, 0o600)
  return str(path)


MINIMAL = ("tenants: [{name: alice, token_file: alice.token, arena: 0.4},"
           " {name: bob, token_file: bob.token, arena: 0.4}]\n")


def test_the_minimal_file(tmp_path):
  pool = pool_file.load(_pool(tmp_path, MINIMAL))
  alice, bob = pool.tenants
  assert (alice.name, alice.token, bob.token) == ("alice", "token-of-alice", "token-of-bob")
  assert alice.arena.bytes_of(1000) == 400 and alice.arena_ceiling is None
  assert alice.sessions is None and alice.allows("function", "anything")
  assert pool.quotas and "token-of" not in repr(pool)  # a token never shows in a repr


def test_every_key(tmp_path):
  (tmp_path / "ckpt" / "alice").mkdir(parents=True)
  pool = pool_file.load(_pool(tmp_path, """\
tenants:
  - name: alice
    token_file: alice.token
    arena: 2GiB
    arena_ceiling: 0.5
    sessions: 8
    calls: 4
    streams: 2
    feeds: 3
    feed_workers: 16
    inline_bytes: 128MiB
    connections: 4
    uids: [1000, 1001]
    tls_names: [alice.example]
    checkpoint_roots: [ckpt/alice]
    functions: [add]
    pipelines: [numbers]
    weight: 2
    ram_tier: 0.25
    checkpoint_bytes: 500GiB
    memory: 2GiB
    tmp_bytes: 64MiB
    processes: 128
    uid: 10001
    gid: 10005
""", "alice"))
  (t,) = pool.tenants
  assert t.arena.nbytes == 2 << 30 and t.arena_ceiling == quotas_lib.Share(fraction=0.5)
  assert (t.sessions, t.calls, t.streams, t.feeds, t.feed_workers) == (8, 4, 2, 3, 16)
  assert t.inline_bytes == 128 * MiB and t.weight == 2.0 and t.line == 2
  assert t.connections == 4 and t.uids == {1000, 1001} and t.tls_names == {"alice.example"}
  assert t.checkpoint_roots == (os.path.realpath(tmp_path / "ckpt" / "alice"),)
  assert t.allows("function", "add") and not t.allows("function", "sub")
  assert t.allows("pipeline", "numbers") and not t.allows("pipeline", "add")
  assert t.ram_tier == quotas_lib.Share(fraction=0.25) and t.checkpoint_bytes == 500 << 30
  assert (t.memory, t.tmp_bytes, t.processes) == (2 << 30, 64 * MiB, 128)
  assert (t.uid, t.gid) == (10001, 10005)


BAD = [
    ("tenants: [{name: alice, token_file: alice.token, colour: red}]\n",
     r"pool.yaml:1: unknown key 'colour' in a tenant \(line 1\); the keys are arena, "),
    ("tenants:\n  - {name: alice, token_file: alice.token}\n  - {name: alice, token_file: "
     "bob.token}\n",
     r"pool.yaml:3: tenant name 'alice' is also the name of the tenant on line 2"),
    ("tenants:\n  - {name: alice, token_file: alice.token}\n  - {name: bob, token_file: "
     "alice.token}\n",
     r"pool.yaml:3: tenant 'bob' has the same token as tenant 'alice' \(line 2\)"),
    ("tenants:\n  - {name: alice, token_file: alice.token, arena: 0.7}\n  - {name: bob, "
     "token_file: bob.token, arena: 0.5}\n",
     r"pool.yaml:2: the tenants' guaranteed arena shares \(alice 0.7, bob 0.5\) sum to 1.2 "
     r"of the arena, more than all of it"),
    ("tenants:\n  - {name: alice, token_file: alice.token,\n     sessions: 0}\n",
     r"pool.yaml:3: tenant 'alice': sessions must be an int >= 1, got 0"),
    ("tenants:\n  - {name: alice, token_file: alice.token, arena_ceiling: 4KiB}\n",
     r"pool.yaml:2: tenant 'alice': arena_ceiling 4.0 KiB is below one batch \(1.0 MiB\)"),
    ("tenants:\n  - {name: alice, token_file: alice.token, inline_bytes: 1KiB}\n",
     r"pool.yaml:2: tenant 'alice': inline_bytes must be a size of at least 64.0 KiB"),
    ("tenants:\n  - {name: alice, token_file: alice.token, arena: lots}\n",
     r"pool.yaml:2: tenant 'alice': arena is a fraction of the arena in \(0, 1\] or a size"),
    ("tenants:\n  - {name: alice}\n", r"pool.yaml:2: tenant 'alice' has no token_file: .* or "
     "its tls_names"),
    ("tenants:\n  - {name: alice, token_file: nobody.token}\n",
     r"pool.yaml:2: tenant 'alice': cannot read its token_file .*nobody.token"),
    ("tenants:\n  - {name: 'a b', token_file: alice.token}\n",
     r"pool.yaml:2: a tenant's name is letters, digits"),
    ("tenant: []\n", r"pool.yaml:1: unknown key 'tenant' in the pool file; the keys are "
     r"operator_token_file, tenants"),
    ("tenants: []\n", r"pool.yaml:1: 'tenants' must be a non-empty list"),
    ("tenants: [\n", r"pool.yaml:2: not YAML"),
    ("tenants:\n  - {name: alice, token_file: alice.token, weight: -1}\n",
     r"pool.yaml:2: tenant 'alice': weight must be a positive number, got -1"),
    ("tenants:\n  - {name: alice, tls_names: [a.example]}\n  - {name: bob, "
     "token_file: bob.token, tls_names: [a.example]}\n",
     r"pool.yaml:3: tenant 'bob' shares tls_names \['a.example'\] with tenant 'alice'"),
    ("tenants:\n  - {name: alice, token_file: alice.token, uids: [7]}\n  - {name: bob, "
     "token_file: bob.token, uids: [8, 7]}\n",
     r"pool.yaml:3: tenant 'bob' shares uids \[7\] with tenant 'alice' \(line 2\)"),
    ("tenants:\n  - {name: alice, token_file: alice.token,\n     checkpoint_bytes: 0.5}\n",
     r"pool.yaml:3: tenant 'alice': checkpoint_bytes must be a size of at least 1.0 MiB"),
    ("tenants:\n  - {name: alice, token_file: alice.token, checkpoint_bytes: 4KiB}\n",
     r"pool.yaml:2: tenant 'alice': checkpoint_bytes must be a size of at least 1.0 MiB"),
    ("tenants:\n  - {name: alice, token_file: alice.token, ram_tier: -1}\n",
     r"pool.yaml:2: tenant 'alice': ram_tier is a fraction of the arena in \(0, 1\] or a size"),
    ("tenants:\n  - {name: alice, token_file: alice.token,\n     uid: 0}\n",
     r"pool.yaml:3: tenant 'alice': uid must be a user id, an int from 1 \(0 is root's: its "
     r"processes would be bounded by nothing\), got 0"),
    ("tenants:\n  - {name: alice, token_file: alice.token, uid: bob}\n",
     r"pool.yaml:2: tenant 'alice': uid must be a user id, .*got 'bob'"),
    ("tenants:\n  - {name: alice, token_file: alice.token, gid: 7}\n",
     r"pool.yaml:2: tenant 'alice': gid is the group of its uid's processes; give its uid too"),
    ("tenants:\n  - {name: alice, token_file: alice.token, uid: 10001}\n  - {name: bob, "
     "token_file: bob.token, uid: 10001}\n",
     r"pool.yaml:3: tenant 'bob' has the uid 10001 of tenant 'alice' \(line 2\); each "
     r"tenant's processes run as a user of its own"),
    ("tenants:\n  - {name: alice, token_file: alice.token, memory: 1MiB}\n",
     r"pool.yaml:2: tenant 'alice': memory must be a size of at least 128.0 MiB"),
    ("tenants:\n  - {name: alice, token_file: alice.token, processes: 4}\n",
     r"pool.yaml:2: tenant 'alice': processes must be an int >= 16, got 4"),
]


@pytest.mark.parametrize("text, match", BAD, ids=[
    "unknown-key", "duplicate-name", "duplicate-token", "guarantees-above-arena",
    "sessions-below-1", "ceiling-below-a-batch", "inline-below-least", "bad-size",
    "no-token-file", "missing-token-file", "bad-name", "unknown-top-key", "no-tenants",
    "not-yaml", "bad-weight", "shared-tls-names", "shared-uids", "storage-a-fraction",
    "storage-below-least", "ram-tier-negative", "uid-root", "uid-not-an-int", "gid-alone",
    "shared-uid", "memory-below-least", "processes-below-least"])
def test_a_bad_file_is_refused_naming_its_line(tmp_path, text, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    pool_file.load(_pool(tmp_path, text))


def test_a_uid_needs_a_sidecar_that_can_switch_user(tmp_path, monkeypatch):
  # Root here: it can (its CapEff holds CAP_SETUID and CAP_SETGID).
  assert pool_file.can_switch_user() == (os.geteuid() == 0)
  text = "tenants:\n  - {name: alice, token_file: alice.token, uid: 10001}\n"
  monkeypatch.setattr(pool_file, "can_switch_user", lambda: False)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:2: tenant 'alice': uid 10001: this sidecar \(uid \d+\) "
                     r"cannot start processes as another user: run it as root, or give its "
                     r"container CAP_SETUID and CAP_SETGID"):
    pool_file.load(_pool(tmp_path, text))


def test_a_uid_s_group_is_its_primary_one_else_its_number(tmp_path):
  import pwd
  nobody = pwd.getpwnam("nobody")
  pool = pool_file.load(_pool(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                              f"uid: {nobody.pw_uid}}}\n  - {{name: bob, token_file: "
                              "bob.token, uid: 54321}\n"))
  alice, bob = pool.tenants
  assert (alice.uid, alice.gid) == (nobody.pw_uid, nobody.pw_gid)
  assert (bob.uid, bob.gid) == (54321, 54321)  # no such user: its number


def test_shares_are_checked_against_the_arena(tmp_path):
  pool = pool_file.load(_pool(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                            "arena: 600MiB}\n  - {name: bob, token_file: bob.token, arena: "
                            "600MiB}\n"))
  pool.check_arena(2 << 30)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:2: the tenants' guaranteed arena shares \(alice 600.0 MiB, "
                     r"bob 600.0 MiB\) sum to 1.2 GiB, more than the arena \(1.0 GiB"):
    pool.check_arena(1 << 30)
  big = pool_file.load(_pool(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                           "arena_ceiling: 2GiB}\n"))
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:2: tenant 'alice': arena_ceiling 2.0 GiB is more than the "
                     r"whole arena \(1.0 GiB, --shm-size\)"):
    big.check_arena(1 << 30)
  ram = pool_file.load(_pool(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                           "ram_tier: 2GiB}\n"))
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:2: tenant 'alice': ram_tier 2.0 GiB is more than the "
                     r"whole arena \(1.0 GiB, --shm-size\), which holds the RAM tier"):
    ram.check_arena(1 << 30)


def test_a_tenants_roots_must_lie_under_the_sidecars(tmp_path):
  pool = pool_file.load(_pool(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                            "checkpoint_roots: [/elsewhere]}\n", "alice"))
  pool.check_roots(("/",))
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:2: tenant 'alice': checkpoint root /elsewhere is under no "
                     r"--checkpoint-root of the sidecar"):
    pool.check_roots((str(tmp_path),))


@pytest.mark.parametrize(("alice", "bob", "how"), [
    ("ckpt", "ckpt", "is"), ("ckpt", "ckpt/bob", "overlaps"), ("ckpt/a", "ckpt", "overlaps")],
    ids=["same", "inside", "above"])
def test_tenants_checkpoint_roots_may_not_overlap(tmp_path, alice, bob, how):
  text = ("tenants:\n"
          f"  - {{name: alice, token_file: alice.token, checkpoint_roots: [x, {alice}]}}\n"
          f"  - {{name: bob, token_file: bob.token, checkpoint_roots: [{bob}]}}\n")
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"pool.yaml:3: tenant 'bob'.s checkpoint root \S+/{bob} {how} tenant "
                     rf"'alice'.s \S+/{alice} \(line 2\); each tenant's checkpoint_roots must be "
                     "directories of its own"):
    pool_file.load(_pool(tmp_path, text, "alice", "bob"))
  pool_file.load(_pool(tmp_path, text.replace(f"[{bob}]", "[ckpt-b]"), "alice", "bob"))


def test_a_world_readable_file_is_named_with_the_fix(tmp_path, caplog):
  path = _pool(tmp_path, MINIMAL)
  os.chmod(path, 0o644)
  os.chmod(tmp_path / "bob.token", 0o644)
  with caplog.at_level(logging.WARNING):
    pool_file.load(path)
  text = caplog.text
  assert f"pool file {path} is readable by everyone (mode 644)" in text
  assert f"chmod 600 {path}" in text
  assert f"chmod 600 {tmp_path / 'bob.token'}" in text and "alice.token" not in text


def _tenancy(tmp_path, text):
  return tenants_lib.Tenancy(pool_file.load(_pool(tmp_path, text)))


def test_a_tenants_handshake_flood_is_its_own(tmp_path):
  tenancy = _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                     "sessions: 3}\n  - {name: bob, token_file: bob.token}\n")
  sessions = Sessions(idle_s=3600, limit=100, tenancy=tenancy)
  mine = [sessions.new(client="alice") for _ in range(3)]
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"tenant 'alice' keeps 3 handshake sessions, its quota \(sessions=3, "
                     r".*pool.yaml:2\), every one used in the last 60 s") as raised:
    sessions.new(client="alice")
  assert not isinstance(raised.value, errors.BusyError)
  # Bob's share by weight is half of max_sessions: his handshakes still work.
  theirs = [sessions.new(client="bob") for _ in range(50)]
  with pytest.raises(errors.ResourceExhaustedError, match=r"tenant 'bob' keeps 50 .* its quota "
                     r"\(its share by weight of max_sessions=100"):
    sessions.new(client="bob")
  assert sessions.count_of() == {"alice": 3, "bob": 50}
  assert sessions.revoke("alice") == 3 and all(not sessions.touch(s) for s in mine)
  assert all(sessions.touch(s) for s in theirs)


def test_a_tenants_idle_session_makes_room_for_its_own_only(tmp_path):
  now = [0.0]
  tenancy = _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                     "sessions: 2}\n  - {name: bob, token_file: bob.token}\n")
  sessions = Sessions(idle_s=3600, limit=100, tenancy=tenancy, clock=lambda: now[0])
  old = sessions.new(client="alice")
  bob = sessions.new(client="bob")
  sessions.new(client="alice")
  now[0] = 61.0
  sessions.new(client="alice")  # alice's oldest goes, not bob's older one
  assert not sessions.touch(old) and sessions.touch(bob)


def test_call_slots_per_tenant(tmp_path):
  tenancy = _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                     "calls: 1}\n  - {name: bob, token_file: bob.token}\n")
  owner = {"s1": "alice", "s2": "alice", "s3": "bob"}
  slots = CallSlots(32, tenancy=tenancy, tenant_of=owner.get)
  with slots.hold("s1"):
    with pytest.raises(errors.ResourceExhaustedError,
                       match=r"tenant 'alice' already runs 1 calls, its quota \(calls=1, "):
      with slots.hold("s2"):
        pass
    with slots.hold("s3"):  # bob's share by weight: 14 of the 28 call slots
      assert slots.tenant_limit("bob")[0] == 14
  with slots.hold("s2"):
    pass


def test_checkpoint_rpcs_per_tenant(tmp_path):
  tenancy = _tenancy(tmp_path, MINIMAL)
  owner = {f"a{i}": "alice" for i in range(9)} | {"b": "bob"}
  slots = CheckpointSlots(tenancy=tenancy, tenant_of=owner.get)
  with contextlib.ExitStack() as held:
    for i in range(8):  # alice's share by weight of 16, over sessions of her own
      held.enter_context(slots.hold(f"a{i}"))
    with pytest.raises(errors.BusyError,  # its own rpcs in flight end: a controller asks again
                       match=r"tenant 'alice' already runs 8 checkpoint rpcs, its quota \(its "
                       r"share by weight of 16, .*pool.yaml:1\)"):
      held.enter_context(slots.hold("a8"))
    held.enter_context(slots.hold("b"))  # bob's own share is untouched


def test_inline_bytes_per_tenant(tmp_path):
  tenancy = _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                     "inline_bytes: 1MiB}\n  - {name: bob, token_file: bob.token}\n")
  inline = InlineBytes(64 * MiB, tenancy=tenancy)
  with tenants_lib.acting_as("alice"):
    with pytest.raises(errors.ResourceExhaustedError,
                       match=r"tenant 'alice' sent an inline request of 2097152 bytes, more "
                       r"than its quota \(inline_bytes=1048576"):
      with inline.hold(2 * MiB, timeout=0):
        pass
    with inline.hold(MiB // 2, timeout=0):
      with pytest.raises(errors.ResourceExhaustedError,
                         match=r"tenant 'alice' is decoding 524288 bytes .* its quota"):
        with inline.hold(MiB, timeout=0.01):
          pass
      with tenants_lib.acting_as("bob"), inline.hold(8 * MiB, timeout=0):
        pass


ARENA = 16 * MiB


def _leases(tmp_path, text):
  tenancy = _tenancy(tmp_path, text)
  workers = {"w-a": "alice", "w-b": "bob"}
  return Leases(shm.Allocator(ARENA), tenancy=tenancy, tenant_of=workers.get)


def test_a_ceiling_caps_a_tenant(tmp_path):
  leases = _leases(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                   "arena_ceiling: 4MiB}\n  - {name: bob, token_file: bob.token}\n")
  a = leases.alloc(3 * MiB, "w-a", timeout=0)
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"tenant 'alice' holds 3.0 MiB of the arena; 2.0 MiB more would pass "
                     r"its quota \(arena_ceiling=4.0 MiB = 4.0 MiB, .*pool.yaml:2\)"):
    leases.alloc(2 * MiB, "w-a", timeout=0)
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"tenant 'alice': a block of 5.0 MiB .* cannot fit its quota"):
    leases.alloc(5 * MiB, "w-a", timeout=0)
  b = leases.alloc(10 * MiB, "w-b", timeout=0)  # bob has no ceiling
  assert leases.tenant_bytes() == {"alice": 3 * MiB, "bob": 10 * MiB}
  leases.release_all("w-a")
  leases.release_all("w-b")
  assert leases.tenant_bytes() == {} and leases.allocator.used_bytes == 0
  del a, b


def test_a_guarantee_is_kept_for_its_tenant(tmp_path):
  leases = _leases(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                   "arena: 0.25}\n  - {name: bob, token_file: bob.token}\n")
  first = leases.alloc(6 * MiB, "w-b", timeout=0)
  leases.alloc(6 * MiB, "w-b", timeout=0)  # all bob may have: alice's quarter stays
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"tenant 'bob' holds 12.0 MiB of the arena; 1.0 MiB more would take "
                     r"from the guaranteed arena of other tenants \(4.0 MiB they are "):
    leases.alloc(MiB, "w-b", timeout=0)
  leases.alloc(4 * MiB, "w-a", timeout=0)  # at once: nobody took it
  # A tenant that waits gets in once room comes back (not from the other's guarantee).
  got = []
  waiter = threading.Thread(target=lambda: got.append(leases.alloc(MiB, "w-b", timeout=5)))
  waiter.start()
  leases.release_all("w-a")
  assert not got
  leases.release(first.offset, first.generation, "w-b")
  waiter.join(5)
  assert got and leases.tenant_bytes() == {"bob": 7 * MiB}
  leases.release_all("w-b")
  assert leases.allocator.used_bytes == 0


def test_feeds_and_feed_workers_per_tenant(tmp_path):
  tenancy = _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                     "feeds: 2, feed_workers: 3}\n  - {name: bob, token_file: bob.token}\n")
  with tenancy.feeding("alice", 2):
    with pytest.raises(errors.ResourceExhaustedError,
                       match=r"tenant 'alice' holds 2 feed worker processes; 2 more would pass "
                       r"its quota \(feed_workers=3, .*pool.yaml:2\)"):
      with tenancy.feeding("alice", 2):
        pass
    with tenancy.feeding("alice", 1):
      with pytest.raises(errors.ResourceExhaustedError,
                         match=r"tenant 'alice' holds 2 feeds; 1 more would pass its quota "
                         r"\(feeds=2"):
        with tenancy.feeding("alice", 0):
          pass
      # bob names no feed_workers: the default, this host's CPUs (issue 76, attack 7: his
      # share of the connections let him start ~254 worker processes of ~240 MiB each).
      cpus = quotas_lib.CPUS
      with tenancy.feeding("bob", cpus):
        assert tenancy.feed_counts() == {"alice": (2, 3), "bob": (1, cpus)}
        with pytest.raises(errors.ResourceExhaustedError,
                           match=rf"tenant 'bob' holds {cpus} feed worker processes; 1 more "
                           rf"would pass its quota \(feed_workers={cpus}, its default "):
          with tenancy.feeding("bob", 1):
            pass
  assert tenancy.feed_counts() == {"alice": (0, 0), "bob": (0, 0)}


def test_allowlists(tmp_path):
  tenancy = _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                     "functions: [add]}\n  - {name: bob, token_file: bob.token}\n")
  tenancy.check_allowed("alice", "function", "add")
  tenancy.check_allowed("bob", "function", "sub")
  with pytest.raises(errors.PermissionDeniedError,
                     match=r"tenant 'alice' may not run function 'sub': its functions "
                     r"allowlist \(.*pool.yaml:2\) holds add; add it there"):
    tenancy.check_allowed("alice", "function", "sub")


def test_a_worker_says_whose_it_is(tmp_path):
  tenancy = _tenancy(tmp_path, MINIMAL)
  assert tenancy.worker_tenant("token-of-bob") == "bob"
  with pytest.raises(errors.AuthenticationError,
                     match=r"a worker must present its tenant's token at attach; set "
                     r"SIDECAR_TOKEN"):
    tenancy.worker_tenant(None)
  with pytest.raises(errors.AuthenticationError, match="or name its user in the tenant's uids"):
    tenancy.worker_tenant(None, uid=os.getuid())
  by_user = _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                     f"uids: [{os.getuid()}]}}\n  - {{name: bob, token_file: bob.token}}\n")
  assert by_user.worker_tenant(None, uid=os.getuid()) == "alice"
  assert by_user.worker_tenant("token-of-bob", uid=os.getuid()) == "bob"  # a token first
  shared = tenants_lib.Tenancy(tenants_lib.Pool.shared("t0"))
  assert shared.worker_tenant(None) == ""  # the shared token: every worker is its tenant's
  assert tenants_lib.Tenancy(None).worker_tenant("x") is None


def test_a_peer_sidecars_link_attaches_for_the_tenant_it_names(tmp_path):
  """A replica link's attach proves the peer token and names its tenant (issue 42): taken
  for that tenant; a wrong peer token, an unknown tenant or none in a pool, refused as the
  sidecars' link (not a trainer's environment)."""
  pool = pool_file.load(_pool(tmp_path, MINIMAL))
  tenancy = tenants_lib.Tenancy(pool, replica_token="peer-secret")
  attach = lambda peer, tenant: tenants_lib.ReplicaAttach(peer, tenant).token()
  assert tenancy.worker_tenant(attach("peer-secret", "bob")) == "bob"
  for token, match in ((attach("wrong", "bob"), "its peer token is not this sidecar's"),
                       (attach("peer-secret", "carol"), "tenant 'carol', which is not in"),
                       (attach("peer-secret", ""), "named no tenant"),
                       ("sidecar-peer-attach:{", "malformed peer attach")):
    with pytest.raises(errors.AuthenticationError, match=match) as info:
      tenancy.worker_tenant(token)
    assert "SIDECAR_TOKEN " not in str(info.value)
  with pytest.raises(errors.AuthenticationError, match="this sidecar has none"):
    tenants_lib.Tenancy(pool).worker_tenant(attach("peer-secret", "bob"))
  shared = tenants_lib.Tenancy(tenants_lib.Pool.shared("t0"), replica_token="peer-secret")
  assert shared.worker_tenant(attach("peer-secret", "")) == ""  # the one tenant, as workers
  assert "peer-secret" not in repr(tenants_lib.ReplicaAttach("peer-secret", "bob"))


def test_a_reload_revokes_removed_tenants(tmp_path):
  path = _pool(tmp_path, MINIMAL)
  tenancy = tenants_lib.Tenancy(pool_file.load(path))
  tokens = tenants_lib.Tokens.of(tenancy.pool, None)
  with open(path, "w") as f:
    f.write("tenants: [{name: alice, token_file: alice.token}]\n")
  pool = pool_file.load(path)
  removed, changed = tenancy.swap(pool)
  assert (removed, changed) == (["bob"], [])
  tokens.swap(tenants_lib.Tokens.of(pool, None), {"bob": tenancy.revoked["bob"]})
  assert tokens.table == {b"Bearer token-of-alice": "alice"}
  assert tokens.revoked == {
      b"Bearer token-of-bob": f"tenant 'bob' was removed from the pool file {path}"}


def test_a_full_table_makes_room_from_a_tenant_over_its_share_never_from_another(tmp_path):
  """Issue 54, attack 3, where the pool file's sessions quotas add up to more than
  max_sessions: bob's handshakes from holders of one session each filled the table, and
  his next made room from the biggest holder, alice's. Now a full table makes room only
  from the new one's tenant or a tenant holding more than its share by weight."""
  tenancy = _tenancy(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                     "sessions: 8}\n  - {name: bob, token_file: bob.token, sessions: 64}\n")
  sessions = Sessions(idle_s=3600, limit=16, tenancy=tenancy, per_client=16)
  alice = [sessions.new(client="alice", holder="unix:@alice") for _ in range(6)]
  bob = [sessions.new(client="bob", holder=f"ipv4:127.0.0.1:{i}") for i in range(10)]
  with pytest.raises(errors.BusyError, match="max_sessions"):  # bob, over his share, waits
    sessions.new(client="bob", holder="ipv4:127.0.0.1:99")
  assert all(sessions.touch(s) for s in alice + bob)
  carol = sessions.new(client="alice", holder="pid:1@alice")  # alice: her biggest holder's
  assert not sessions.touch(alice[0]) and sessions.touch(carol)
  # A tenant under its share, new to a table another tenant overfilled: room from that one.
  full = Sessions(idle_s=3600, limit=16, tenancy=tenancy, per_client=16)
  theirs = [full.new(client="bob", holder="unix:@bob") for _ in range(16)]
  full.new(client="alice", holder="unix:@alice")
  assert not full.touch(theirs[0]) and all(full.touch(s) for s in theirs[1:])
