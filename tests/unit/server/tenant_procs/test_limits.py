"""A tenant process's limits from its pool file entry (server/tenant_procs/limits.py): each
key's value and what set it, the nice level by weight, and the errors a limit met becomes
(typed, naming the key and the tenant).

Tier 1: pool files in a temporary directory, no process.
"""

import errno
import json
import os

import pytest

from sidecar._src.core import errors
from sidecar._src.server.pool import pool_file
from sidecar._src.server.tenancy import quotas as quotas_lib
from sidecar._src.server.tenant_procs import limits as limits_lib

pytestmark = pytest.mark.unit


def _pool(tmp_path, alice: str = "", bob: str = ""):
  for name in ("alice", "bob"):
    (tmp_path / f"{name}.token").write_text(f"token-of-{name}\n")
    os.chmod(tmp_path / f"{name}.token", 0o600)
  path = tmp_path / "pool.yaml"
  path.write_text("tenants:\n"
                  f"  - {{name: alice, token_file: alice.token{alice}}}\n"
                  f"  - {{name: bob, token_file: bob.token{bob}}}\n")
  os.chmod(path, 0o600)
  return pool_file.load(str(path))


def test_each_limit_is_its_key_or_its_default_and_says_what_set_it(tmp_path):
  pool = _pool(tmp_path, ", open_files: 64, memory: 1GiB, tmp_bytes: 8MiB, uid: 10001",
               ", weight: 3")
  alice, bob = (limits_lib.ProcessLimits.of(t, pool) for t in pool.tenants)
  assert (alice.open_files, alice.nofile, alice.memory, alice.tmp_bytes) == (
      64, 64 + limits_lib.OWN_FILES, 1 << 30, 8 << 20)
  assert (alice.uid, alice.gid, alice.processes) == (10001, 10001, 512)
  assert alice.why("memory") == f"memory=1.0 GiB, {tmp_path}/pool.yaml:2"
  assert bob.memory == 4 << 30 and "memory=4.0 GiB, its default" in bob.why("memory")
  assert bob.processes is None and bob.uid is None  # no user of its own: no RLIMIT_NPROC
  assert bob.tmp_bytes == quotas_lib.TMP_TOTAL * 3 // 4  # its share by weight
  assert limits_lib.ProcessLimits.from_dict(json.loads(json.dumps(alice.to_dict()))) == alice


@pytest.mark.parametrize("weights, nice", [((1, 1), (0, 0)), ((2, 1), (0, 3)),
                                           ((8, 1), (0, 9)), ((1000, 1), (0, 19))],
                         ids=["equal", "half", "eighth", "at-most-19"])
def test_a_lighter_tenant_s_process_is_nicer(tmp_path, weights, nice):
  pool = _pool(tmp_path, f", weight: {weights[0]}", f", weight: {weights[1]}")
  assert tuple(limits_lib.ProcessLimits.of(t, pool).nice for t in pool.tenants) == nice


@pytest.mark.parametrize("raised, key, what", [
    (MemoryError(), "memory", "ran out of memory"),
    (OSError(errno.EMFILE, "Too many open files"), "open_files", "has no descriptor left"),
    (RuntimeError("... RandomAccessFile: Too many open files"), "open_files",
     "has no descriptor left"),
    (errors.ResourceExhaustedError("opening 'x': Too many open files; this process holds too "
                                   "many files"), "open_files", "has no descriptor left"),
    (errors.RemoteError("builtins.MemoryError", "Unable to allocate 2.0 GiB"), "memory",
     "ran out of memory"),
    (OSError(errno.EFBIG, "File too large"), "tmp_bytes", "wrote a file past its size limit"),
], ids=["memory", "emfile", "a-library-s", "data-paths-own", "a-feed-worker-s", "efbig"])
def test_a_limit_met_is_resource_exhausted_naming_the_key_and_the_tenant(tmp_path, raised, key,
                                                                           what):
  pool = _pool(tmp_path, ", memory: 1GiB")
  alice = limits_lib.ProcessLimits.of(pool.tenants[0], pool)
  typed = alice.typed(raised)
  assert isinstance(typed, errors.ResourceExhaustedError)
  assert str(typed).startswith(f"tenant 'alice''s process {what}")
  assert f"past its limit ({key}=" in str(typed)


@pytest.mark.parametrize("raised", [ValueError("bad"), errors.PermissionDeniedError("no"),
                                    errors.RemoteError("builtins.KeyError", "x"),
                                    OSError(errno.ENOENT, "gone")],
                         ids=["user-s", "ours", "a-feed-worker-s", "another-os-error"])
def test_anything_else_is_as_it_was(tmp_path, raised):
  pool = _pool(tmp_path)
  assert limits_lib.ProcessLimits.of(pool.tenants[0], pool).typed(raised) is raised
