"""Isolation, round 5, attack 4 (issue 54): a tenant whose Unix user owns his checkpoint
directory swaps his committed step for a copy he owns, then flips a chunk file between a
file and a symlink to alice's root-only token file while his client Reads part of the leaf
from disk. A pool sidecar in its own process, bob's attack in a process of another user.

Before: a read that is not one whole chunk went through TensorStore, which opened the chunk
by path after the sidecar's lstat walk: the Read returned alice's token. Now TensorStore is
handed only paths through the item directory's descriptor, in a tree nobody else can
change; in bob's tree the chunk is read whole with no-symlink opens and sliced, or refused.
"""

import os
import pwd
import secrets
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt.records import ShardId, ShardRecord
from tests.support.pool_files import ALICE, BOB, write_pool

pytestmark = pytest.mark.processes

try:
  NOBODY = pwd.getpwnam("nobody").pw_uid
except KeyError:
  NOBODY = 65534
SECRET = ALICE + "-" + "s" * (31 - len(ALICE)) + "\n"  # alice's 33-byte token file
POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice]}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob]}
"""

# Bob's user: its imports done as root (the interpreter's files may be root's alone), it
# becomes uid NOBODY, swaps step 1 for a copy of its own, says so, then flips w/0 between
# a file of bob's bytes and a symlink to alice's token until it is killed.
_ATTACK = r"""
import os, shutil, sys
ck, secret, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
step = os.path.join(ck, "1")
shutil.copytree(step, step + ".copy")
os.rename(step, step + ".orig"); os.rename(step + ".copy", step)
chunk = os.path.join(step, "default", "w", "0")
shutil.copyfile(chunk, os.path.join(ck, "bytes"))
print("swapped", flush=True)
while True:
  shutil.copyfile(os.path.join(ck, "bytes"), os.path.join(ck, "f.tmp"))
  os.rename(os.path.join(ck, "f.tmp"), chunk)
  os.symlink(secret, os.path.join(ck, "l.tmp"))
  os.rename(os.path.join(ck, "l.tmp"), chunk)
"""


@pytest.fixture
def shared():
  """A directory in /tmp every user may enter (the pool's files, the tenants' roots), with
  bob's checkpoint directory owned by the other user; removed after."""
  if os.geteuid() != 0:
    pytest.skip(f"a second Unix user needs root here (setuid to uid {NOBODY}); this runs as "
                f"uid {os.geteuid()}; the checks themselves are in tests/unit/ckptfmt/")
  directory = f"/tmp/sidecar-paths-{secrets.token_hex(6)}"
  os.mkdir(directory, 0o755)
  try:
    yield directory
  finally:
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.timeout(240)
def test_a_sub_chunk_read_never_follows_a_chunk_flipped_to_a_symlink(shared):
  import pathlib
  base = pathlib.Path(shared)
  pool = write_pool(base, POOL)
  secret = base / "alice.token"
  secret.write_text(SECRET)  # alice's token, root's alone
  os.chmod(secret, 0o600)
  ck = base / "bob" / "ck"
  ck.mkdir()
  os.chown(ck, NOBODY, NOBODY)  # bob's Unix user owns his checkpoint directory
  w = np.arange(len(SECRET), dtype=np.uint8) + 100  # one chunk, the token's size
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    pool=pool) as cluster:
    with cluster.controller(token=BOB) as ctl:
      with ctl.checkpointer(str(ck)) as ck_:
        assert ck_.save(1, {"w": w}).durable.result(60) == 1
      attack = subprocess.Popen([sys.executable, "-c", _ATTACK, str(ck), str(secret),
                                 str(NOBODY)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
      try:
        assert attack.stdout.readline().strip() == "swapped", attack.stderr.read()
        client = ctl.checkpoint_client()
        # bytes [0, 32): not a whole chunk; no dtype recorded, as an earlier release's record
        shard = ShardRecord(ShardId(("w",), ((0, 32),)), 0, None, "", (), 0)
        served, refused = 0, []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and served + len(refused) < 400:
          try:
            got = client.read(0, str(ck / "1" / "default"), shard, tier="disk",
                              checked=False).result(30)
          except sidecar.SidecarError as e:
            refused.append(e)
            continue
          got = np.asarray(got).tobytes()
          assert SECRET[:8].encode() not in got, f"read {served + len(refused)}: {got!r}"
          assert got == w[:32].tobytes(), got
          served += 1
      finally:
        attack.kill()
        attack.wait(10)
  assert attack.returncode is not None
  # Both happened: bob's own bytes while the chunk was a file, a refusal naming the
  # symlink while it was one; never alice's token.
  assert served and refused, (served, refused[:3])
  for e in refused:
    assert isinstance(e, sidecar.PermissionDeniedError), repr(e)
    assert "is a symlink" in str(e) and "/ck/1/default/w/0" in str(e), str(e)
