"""Isolation, round 6, item 1 (issue 63): a pool tenant's pipelines read only beneath its
data roots. One pool sidecar in its own process, tenants alice and bob (each one's
checkpoint root its data root), public API only; bob's corpus written by a Unix user of
his own (uid ``nobody``), who gets EACCES on alice's 0600 shard.

Before: the sidecar opened whatever path a feed's arguments named, as root, following
links: bob's ``feed("lm", data=<alice's corpus>)`` returned her bytes, and so did his own
corpus whose manifest named her shard by an absolute path, by ``../``, or through a
symlink; a Parquet glob over her root read her tables; and a Parquet path outside his roots
answered differently whether or not a file was there (an existence oracle).
"""

import os
import pwd
import secrets
import shutil
import subprocess
import sys

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from pipelines import lm
from tests.support.pool_files import ALICE, BOB, write_pool

pytestmark = pytest.mark.processes

try:
  NOBODY = pwd.getpwnam("nobody").pw_uid
except KeyError:
  NOBODY = 65534
POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice]}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob]}
"""
SEQ_LEN = 8
ALICE_TEXT = b"alice's secret corpus " * 20
BOB_TEXT = bytes(range(256)) * 2
SHARD = "corpus-00000.array_record"

# Bob's user: imports done as root (the interpreter's files may be root's alone), it becomes
# uid NOBODY, tries alice's shard (EACCES, said on its first line), then writes its corpus
# and three hostile copies of it whose manifests name alice's shard.
_BOB_WRITES = r"""
import json, os, shutil, sys
from pipelines import lm
bob, alice_shard, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
try:
  open(alice_shard, "rb")
  print("read alice's shard", flush=True)
except PermissionError as e:
  print("EACCES" if e.errno == 13 else e, flush=True)
corpus = os.path.join(bob, "corpus")
lm.write_corpus(corpus, [bytes(range(256)) * 2], record_bytes=64, shard_bytes=1024)
manifest = json.load(open(os.path.join(corpus, "manifest.json")))
for name, shard in (("abs", alice_shard),
                    ("dotdot", "../../alice/corpus/corpus-00000.array_record"),
                    ("link", "corpus-00000.array_record")):
  os.mkdir(os.path.join(bob, name))
  with open(os.path.join(bob, name, "manifest.json"), "w") as f:
    json.dump({**manifest, "shards": [shard]}, f)
os.symlink(alice_shard, os.path.join(bob, "link", "corpus-00000.array_record"))
print("written", flush=True)
"""


@pytest.fixture(scope="module")
def pool():
  """The pool sidecar and its directory: alice's corpus and tables in her root (0700, files
  0600, root's), bob's root his own user's, holding his corpus and the hostile ones."""
  if os.geteuid() != 0:
    pytest.skip(f"a second Unix user needs root here (setuid to uid {NOBODY}); this runs as "
                f"uid {os.geteuid()}; the resolver's checks are in tests/unit/user/")
  import pathlib
  base = pathlib.Path(f"/tmp/sidecar-roots-{secrets.token_hex(6)}")
  base.mkdir(0o755)
  try:
    path = write_pool(base, POOL)
    lm.write_corpus(base / "alice" / "corpus", [ALICE_TEXT], record_bytes=64, shard_bytes=1024)
    (base / "alice" / "tables").mkdir()
    pq.write_table(pa.table({"x": np.arange(8)}), base / "alice" / "tables" / "t.parquet")
    for p in (base / "alice").rglob("*"):
      os.chmod(p, 0o700 if p.is_dir() else 0o600)
    os.chmod(base / "alice", 0o700)
    os.chown(base / "bob", NOBODY, NOBODY)
    writer = subprocess.run([sys.executable, "-c", _BOB_WRITES, str(base / "bob"),
                             str(base / "alice" / "corpus" / SHARD), str(NOBODY)],
                            capture_output=True, text=True, timeout=120)
    assert writer.stdout.split() == ["EACCES", "written"], writer.stderr
    with sidecar.testing.LocalCluster(
        1, 1, shm_size="32MiB", pool=path, checkpoint_roots=[str(base)],
        imports=["pipelines.lm", "pipelines.parquet", "tests.support.feed_fns"]) as cluster:
      yield cluster, base
  finally:
    shutil.rmtree(base, ignore_errors=True)


def _rows(ctl, name, kwargs, *, key, workers=0, n=2):
  rows = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with ctl.feed(name, global_batch_size=2, sharding=rows, kwargs=kwargs,
                options=sidecar.FeedOptions(workers=workers)) as feed:
    return np.concatenate([np.asarray(next(feed)[key]) for _ in range(n)])


def _refused(ctl, name, kwargs):
  """The error bob's feed of ``name`` raises; his next feed is served (no host was lost)."""
  with pytest.raises(sidecar.SidecarError) as e:
    _rows(ctl, name, kwargs, key="tokens" if name == "lm" else "x")
  assert not isinstance(e.value, sidecar.HostLostError), repr(e.value)
  assert ALICE_TEXT[:16].decode() not in str(e.value)
  return e.value


def _tokens_of(text: bytes, tokens: np.ndarray) -> bool:
  return all(bytes(row.astype(np.uint8)) in text for row in tokens)


@pytest.mark.timeout(300)
def test_bob_reads_none_of_alices_data_by_any_path(pool):
  cluster, base = pool
  alice_corpus = str(base / "alice" / "corpus")
  with cluster.controller(token=ALICE) as alice:  # her own corpus: hers to read
    assert _tokens_of(ALICE_TEXT, _rows(alice, "lm", {"data": alice_corpus, "seq_len": SEQ_LEN},
                                        key="tokens"))
  with cluster.controller(token=BOB) as bob:
    mine = _rows(bob, "lm", {"data": str(base / "bob" / "corpus"), "seq_len": SEQ_LEN},
                 key="tokens", workers=2)
    assert _tokens_of(BOB_TEXT, mine)
    # 1. Her corpus by its path: refused before anything is looked up, naming his roots.
    e = _refused(bob, "lm", {"data": alice_corpus, "seq_len": SEQ_LEN})
    assert isinstance(e, sidecar.PermissionDeniedError)
    assert f"is not under tenant 'bob''s data roots ({base}/bob" in str(e)
    # 2. His own corpus, its manifest naming her shard absolutely or by '..': no names.
    for hostile in ("abs", "dotdot"):
      e = _refused(bob, "lm", {"data": str(base / "bob" / hostile), "seq_len": SEQ_LEN})
      assert isinstance(e, sidecar.InvalidArgumentError), (hostile, repr(e))
      assert "is no name inside" in str(e), str(e)
    # 3. ... or a shard that is his symlink to hers: it leads out of his root.
    e = _refused(bob, "lm", {"data": str(base / "bob" / "link"), "seq_len": SEQ_LEN})
    assert isinstance(e, sidecar.PermissionDeniedError)
    assert f"/bob/link/{SHARD}' leads out of its data root '{base}/bob'" in str(e)
    # 4. A glob over her root, naming no file of hers.
    e = _refused(bob, "parquet", {"paths": f"{base}/alice/*/*.parquet"})
    assert isinstance(e, sidecar.PermissionDeniedError) and "is not under" in str(e)
    # Still served: the sidecar lives, and his own corpus feeds.
    assert _tokens_of(BOB_TEXT, _rows(bob, "lm", {"data": str(base / "bob" / "corpus"),
                                                  "seq_len": SEQ_LEN}, key="tokens"))


def test_no_existence_oracle_outside_and_a_clear_not_found_inside(pool):
  cluster, base = pool
  with cluster.controller(token=BOB) as bob:
    # A root-only file that exists and one that does not, both outside his roots: the same
    # refusal, made before any filesystem call (only the path differs).
    there = _refused(bob, "parquet", {"paths": str(base / "alice.token")})
    missing = _refused(bob, "parquet", {"paths": str(base / "nothing.parquet")})
    assert type(there) is type(missing) is sidecar.PipelinePermissionDeniedError
    assert str(there).replace("alice.token", "X") == str(missing).replace("nothing.parquet", "X")
    # Missing inside his root: NotFoundError naming the path and his roots.
    e = _refused(bob, "parquet", {"paths": str(base / "bob" / "nothing.parquet")})
    assert isinstance(e, sidecar.NotFoundError) and isinstance(e, FileNotFoundError)
    assert "no Parquet file at" in str(e) and "under tenant 'bob''s data roots" in str(e)


def test_feed_worker_processes_hold_the_same_roots(pool):
  cluster, _ = pool
  rows = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with cluster.controller(token=BOB) as bob:
    (sidecar_pid,) = bob.call("sidecar_pid")  # one host
    with bob.feed("data_roots_seen", global_batch_size=2, sharding=rows,
                  options=sidecar.FeedOptions(workers=2)) as feed:
      batches = [next(feed) for _ in range(4)]
  # Each row made in a worker process (not the sidecar), whose context held bob's one root.
  assert {int(r) for b in batches for r in np.asarray(b["roots"])} == {1}
  assert sidecar_pid not in {int(p) for b in batches for p in np.asarray(b["pid"])}
