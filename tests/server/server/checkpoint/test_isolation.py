"""Tier 2: one pool tenant (bob) against another's (alice's) checkpoints, names not paths,
ownership on disk and storage quotas that racing parts cannot pass (issue 42, attacks 1,
2, 4, 5, 7, 14 and 15). Each attack speaks the Checkpoint service through the client's
own calls, with none of the Checkpointer's checks; each one used to work."""

import json
import pathlib
import threading

import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt import dcp, spec as spec_lib
from sidecar._src.ckptfmt.records import ShardId, ShardRecord
from sidecar._src.ckptfmt.save_values import Abort, Begin, Commit, Prepared, Stage
from sidecar._src.server.checkpoint import roots as roots_lib
from tests.support.pool_files import ALICE, BOB, controller, write_pool
from tests.support.staged import staged

pytestmark = pytest.mark.server

W = np.arange(1024, dtype=np.float32)


def pool(alice: str = "", bob: str = "", extra: str = "") -> str:
  """Two tenants, each with ``alice``/``bob`` as the rest of its line."""
  return ("tenants:\n"
          f"  - {{name: alice, token_file: alice.token{alice}}}\n"
          f"  - {{name: bob, token_file: bob.token{bob}}}\n" + extra)


def saved(server, directory, value: float = 1.0, step: int = 1) -> None:
  with controller(server, ALICE) as ctl, ctl.checkpointer(str(directory)) as ck:
    assert ck.save(step, {"w": W + value}).durable.result(30) == step


def restored(server, directory, step: int = 1) -> np.ndarray:
  with controller(server, ALICE) as ctl, ctl.checkpointer(str(directory)) as ck:
    return ck.restore(step, target={"w": np.zeros_like(W)})["w"]


def refused(kind: type, match: str, fn) -> str:
  with pytest.raises(sidecar.SidecarError) as info:
    fn()
  assert isinstance(info.value, kind), repr(info.value)
  assert match in str(info.value), str(info.value)
  return str(info.value)


def files_under(path: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ---- names, not paths -----------------------------------------------------------------


def test_a_dcp_plan_item_at_an_absolute_path_is_refused_at_the_commit(make_server, tmp_path):
  """Attack 1: a one-rank DCP save whose plan says its item lies in alice's token file;
  the read of that item then got the file's bytes."""
  server = make_server(pool=write_pool(tmp_path, pool(bob=", checkpoint_roots: [bob]")))
  secret = tmp_path / "alice.token"
  path = tmp_path / "bob" / "ck"
  item = dcp.Item(fqn="w", kind="bytes", nbytes=len(ALICE) + 1)
  with controller(server, BOB) as ctl:
    client = ctl.checkpoint_client()
    client.open(0, str(path.parent), ram_steps=1, ram_budget=None, sweep=False).result()
    tmp = client.send(0, Begin(str(path), 1, dcp.FORMAT)).result()
    data = np.zeros(item.nbytes, np.uint8)
    client.send(0, Stage(directory=str(path.parent), step=1, tmp_dir=tmp, final_dir=str(path),
                          leaves=[], shards=[staged(("w",), 0, (), data, rank=0)], last=True,
                          extra=dcp.DcpPart(0, 1))).result()
    sums = client.send(0, Prepared(str(path), 30), timeout=30).result()
    _, size = dcp.layout(0, [item])
    plan = {"version": 1, "state": {"w": {"kind": "bytes"}},
            "storage": [{"fqn": "w", "offset": None, "index": 0, "path": str(secret), "at": 0,
                         "length": item.nbytes}]}
    message = refused(ValueError, "plan_json storage[0].path", lambda: client.send(
        0, Commit(tmp_dir=tmp, step=1, num_hosts=1, leaves=[], shards=sums, data_state_json="",
                  whole_step=True, replicas=None,
                  extra=dcp.DcpCommit(b"\x80\x04N.", {0: size}, json.dumps(plan))),
        timeout=10).result())
    assert str(secret) in message and "__<rank>_0.distcp" in message, message
    plan["storage"][0]["path"] = "../alice.token"  # relative, but out of the directory
    refused(ValueError, "no empty, '.' or '..' component", lambda: client.send(
        0, Commit(tmp_dir=tmp, step=1, num_hosts=1, leaves=[], shards=sums, data_state_json="",
                  whole_step=True, replicas=None,
                  extra=dcp.DcpCommit(b"\x80\x04N.", {0: size}, json.dumps(plan))),
        timeout=10).result())
    assert not path.exists()  # nothing committed, so nothing reads the token from storage
    client.send(0, Abort(tmp, str(path)), timeout=10).result()


def test_an_orbax_leaf_key_that_is_an_absolute_path_is_refused(make_server, tmp_path):
  """Attack 2: a leaf keyed by alice's array directory (his save overwrote her chunk, a
  read through it got her bytes), or by a directory outside every root (files were made
  there)."""
  server = make_server(pool=write_pool(tmp_path, pool(", checkpoint_roots: [alice]",
                                                      ", checkpoint_roots: [bob]")))
  alice_dir = tmp_path / "alice" / "run"
  saved(server, alice_dir, 1.0)
  before = files_under(alice_dir)
  outside = tmp_path / "outside"
  directory = tmp_path / "bob" / "run"
  with controller(server, BOB) as ctl:
    client = ctl.checkpoint_client()
    client.open(0, str(directory), ram_steps=1, ram_budget=None, sweep=True).result()
    tmp = client.send(0, Begin(str(directory), 1, "orbax")).result()
    for key in (str(alice_dir / "1" / "default" / "w"), str(outside / "w"), "a/../../w"):
      leaf = spec_lib.LeafSpec(key_path=(key,), shape=W.shape, dtype=W.dtype)
      evil = staged((key,), 0, ((0, W.size),), np.full_like(W, 666.0))
      refused(ValueError, "leaves[0].key_path must be a name",
              lambda leaf=leaf, evil=evil: client.send(
                  0, Stage(directory=str(directory), step=1, tmp_dir=f"{tmp}/default",
                           final_dir=str(directory / "1" / "default"), leaves=[leaf],
                           shards=[evil], last=True)).result())
      refused(ValueError, "record.shard.key_path must be a name", lambda key=key: client.read(
          0, str(directory / "1" / "default"),
          ShardRecord.of(ShardId((key,), ((0, W.size),)), 0, W), tier="any").result())
  assert not outside.exists() and files_under(alice_dir) == before
  np.testing.assert_array_equal(restored(server, alice_dir), W + 1.0)


# ---- ownership on disk ----------------------------------------------------------------


def test_no_tenant_opens_a_root_or_a_directory_above_or_in_another_tenants_root(
    make_server, tmp_path):
  """Attack 4: bob (no checkpoint_roots) opened the directory above alice's root (here a
  checkpoint root of the sidecar itself): alice was refused her own directory."""
  server = make_server(pool=write_pool(tmp_path, pool(", checkpoint_roots: [alice]")),
                       checkpoint_roots=(str(tmp_path),))
  with controller(server, BOB) as ctl:
    client = ctl.checkpoint_client()
    for where, how in ((tmp_path, "holds"), (tmp_path / "alice", "is"),
                       (tmp_path / "alice" / "run", "lies in")):
      message = refused(PermissionError, f"{how} {str(tmp_path / 'alice')!r}", lambda w=where:
                        client.open(0, str(w), ram_steps=1, ram_budget=None,
                                    sweep=True).result())
      assert "a checkpoint root of tenant 'alice'" in message and "pool.yaml:2" in message
  saved(server, tmp_path / "alice" / "run", 1.0)  # alice is not locked out
  np.testing.assert_array_equal(restored(server, tmp_path / "alice" / "run"), W + 1.0)
  assert (tmp_path / "alice" / "run" / roots_lib.OWNER_FILE).read_text() == "alice\n"


def test_ownership_survives_a_restart(make_server, tmp_path):
  """Attack 5: after the sidecar restarted, bob opened alice's directory first, listed and
  read her step, and she was refused it. Neither tenant has checkpoint_roots here: the
  owner file alone keeps the directory hers, and the directories in and above it."""
  pool_file = write_pool(tmp_path, pool())
  first = make_server(pool=pool_file)
  directory = tmp_path / "shared" / "alice-run"
  saved(first, directory, 1.0)
  first.stop(grace=0)
  server = make_server(pool=pool_file)  # restarted: nothing in memory
  with controller(server, BOB) as ctl:
    client = ctl.checkpoint_client()
    for where, how in ((directory, "is"), (directory.parent, "holds"),
                       (directory / "1", "lies in")):
      message = refused(PermissionError, f"{how} {str(directory)!r}, which client 'alice' "
                        "owns", lambda w=where: client.open(0, str(w), ram_steps=1,
                                                            ram_budget=None, sweep=True).result())
      assert f"remove {str(directory / roots_lib.OWNER_FILE)!r}" in message, message
    refused(PermissionError, "in no checkpoint directory client 'bob' opened", lambda: client.read(
        0, str(directory / "1" / "default"),
        ShardRecord.of(ShardId(("w",), ((0, W.size),)), 0, W), tier="any").result())
  np.testing.assert_array_equal(restored(server, directory), W + 1.0)
  saved(server, directory, 2.0, step=2)  # still hers to save in


# ---- checkpoint_bytes: checked and reserved under one lock -------------------------------

QUOTA_POOL = pool(bob=", checkpoint_roots: [bob], checkpoint_bytes: 4MiB")
BIG = np.ones(1 << 18, np.float32)  # 1 MiB a step


def _race(server, tmp_path, directory_of) -> int:
  """8 of bob's sessions stage a 1 MiB step each at once (each Stage's ``directory`` field
  what ``directory_of(directory, tmp)`` says) and commit; the steps committed."""
  barrier = threading.Barrier(8)
  committed = []
  leaf = spec_lib.LeafSpec(key_path=("w",), shape=BIG.shape, dtype=BIG.dtype)

  def one(i: int) -> None:
    directory = tmp_path / "bob" / f"run{i}"
    with controller(server, BOB) as ctl:
      client = ctl.checkpoint_client()
      client.open(0, str(directory), ram_steps=1, ram_budget=None, sweep=True).result()
      tmp = client.send(0, Begin(str(directory), 1, "orbax")).result()
      final = str(directory / "1" / "default")
      barrier.wait(30)
      try:
        client.send(0, Stage(directory=directory_of(directory, tmp), step=1,
                              tmp_dir=f"{tmp}/default", final_dir=final, leaves=[leaf],
                              shards=[staged(("w",), 0, ((0, BIG.size),), BIG)],
                              last=True)).result()
        sums = client.send(0, Prepared(final, 30), timeout=30).result()
        client.send(0, Commit(tmp_dir=f"{tmp}/default", step=1, num_hosts=1, leaves=[leaf],
                                shards=sums, data_state_json="", whole_step=True, replicas=None),
                      timeout=30).result()
        committed.append(i)
      except sidecar.SidecarError:
        client.send(0, Abort(tmp, final), timeout=30).result()

  threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  return len(committed)


@pytest.mark.parametrize("field", ["a-subdirectory", "honest"])
def test_racing_saves_cannot_pass_checkpoint_bytes(make_server, tmp_path, field):
  """Attack 7: 8 sessions staging 1 MiB steps at once against 4 MiB: 6-8 committed where
  each Stage named a subdirectory of its step as its directory (5 with honest fields).

  With honest fields the race is lined up: after its quota check each Stage waits (up to
  5 s) for all 8 to be checked, which only a check outside the reservation's lock allows."""
  server = make_server(pool=write_pool(tmp_path, QUOTA_POOL), shm_size=32 << 20)
  directory_of = ((lambda d, tmp: f"{tmp}/default") if field == "a-subdirectory"
                  else (lambda d, tmp: str(d)))
  if field == "honest":
    lined_up, check = threading.Barrier(8, timeout=5), server.checkpoints.check_storage

    def checked_together(client, directory, nbytes):
      check(client, directory, nbytes)
      if nbytes:  # a Stage's, not a Begin's: none stages before all 8 are checked
        try:
          lined_up.wait()
        except threading.BrokenBarrierError:
          pass  # the checks are one at a time
    server.checkpoints.check_storage = checked_together
  n = _race(server, tmp_path, directory_of)
  assert n * BIG.nbytes <= 4 << 20, n
  # The steps' data within the quota (their small metadata files may come after a check).
  assert n == 0 if field == "a-subdirectory" else n in (3, 4), n
  stored = sum(p.stat().st_size for p in (tmp_path / "bob").rglob("*") if p.is_file())
  assert stored <= (4 << 20) + (64 << 10), stored


# ---- DCP's siblings, and roots narrowed by a reload -----------------------------------


def test_a_dcp_save_at_a_tenants_root_removes_nothing_beside_it(make_server, tmp_path):
  """Attack 14: Begin(format="dcp") of bob's own root deleted the planted
  ``<root>/bob.dcp-checkpoint-tmp/keep.txt``, outside his roots, and made it anew."""
  server = make_server(pool=write_pool(tmp_path, pool(bob=", checkpoint_roots: [bob]")))
  planted = tmp_path / ("bob" + dcp.TMP_SUFFIX) / "keep.txt"
  planted.parent.mkdir()
  planted.write_text("keep")
  with controller(server, BOB) as ctl:
    client = ctl.checkpoint_client()
    client.open(0, str(tmp_path / "bob"), ram_steps=1, ram_budget=None, sweep=True).result()
    message = refused(PermissionError, "is in no checkpoint directory client 'bob' opened",
                      lambda: client.send(0, Begin(str(tmp_path / "bob"), 1, dcp.FORMAT)).result())
    assert str(planted.parent) in message, message
  assert planted.read_text() == "keep" and files_under(planted.parent) == ["keep.txt"]
  # Inside a directory of his own too, a sibling no save made stays where it is.
  inside = tmp_path / "bob" / ("ck" + dcp.TMP_SUFFIX) / "keep.txt"
  inside.parent.mkdir()
  inside.write_text("keep")
  with controller(server, BOB) as ctl:
    client = ctl.checkpoint_client()
    client.open(0, str(tmp_path / "bob"), ram_steps=1, ram_budget=None, sweep=True).result()
    refused(PermissionError, "was not made by one", lambda: client.send(
        0, Begin(str(tmp_path / "bob" / "ck"), 1, dcp.FORMAT)).result())
  assert inside.read_text() == "keep"


def test_roots_narrowed_by_a_reload_hold_at_the_next_call(make_server, tmp_path):
  """Attack 15: after bob's checkpoint_roots were narrowed and the pool reloaded, he
  committed steps 2 and 3 in the old place (same session, and a new one without
  reopening)."""
  pool_file = write_pool(tmp_path, pool(bob=", checkpoint_roots: [bob, bob2]"))
  (tmp_path / "bob2").mkdir()
  server = make_server(pool=pool_file)
  directory = tmp_path / "bob2" / "run"
  with controller(server, BOB) as ctl, ctl.checkpointer(str(directory)) as ck:
    assert ck.save(1, {"w": W}).durable.result(30) == 1
    pathlib.Path(pool_file).write_text(pool(bob=", checkpoint_roots: [bob]"))
    server.reload()
    refused(PermissionError, "may checkpoint only under its checkpoint_roots",
            lambda: (ck.save(2, {"w": W}), ck.wait()))
    with controller(server, BOB) as other:  # a new session, not reopening
      client = other.checkpoint_client()
      refused(PermissionError, "may checkpoint only under its checkpoint_roots",
              lambda: client.send(0, Begin(str(directory), 3, "orbax")).result())
      refused(PermissionError, "may checkpoint only under its checkpoint_roots",
              lambda: client.read(0, str(directory / "1" / "default"),
                                  ShardRecord.of(ShardId(("w",), ((0, W.size),)), 0, W),
                                  tier="any").result())
  assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["1"]


def test_an_abort_removes_no_dcp_directory_a_save_did_not_make(make_server, tmp_path):
  """STYLE 27: ``Abort`` of a planted ``*.dcp-checkpoint-tmp`` in a directory of one's own
  removed it whole."""
  server = make_server(pool=write_pool(tmp_path, pool(bob=", checkpoint_roots: [bob]")))
  planted = tmp_path / "bob" / ("ck" + dcp.TMP_SUFFIX) / "keep.txt"
  planted.parent.mkdir()
  planted.write_text("keep")
  with controller(server, BOB) as ctl:
    client = ctl.checkpoint_client()
    client.open(0, str(tmp_path / "bob"), ram_steps=1, ram_budget=None, sweep=False).result()
    refused(PermissionError, "was not made by a save", lambda: client.send(
        0, Abort(str(planted.parent), str(tmp_path / "bob" / "ck")), timeout=10).result())
  assert planted.read_text() == "keep"


def test_a_plan_nested_past_the_interpreters_depth_is_an_invalid_argument(make_server,
                                                                           tmp_path):
  """Round five (issue 54): a 100,000-deep plan_json answered
  ``UNKNOWN: builtins.RecursionError``; every error on the wire is a documented one."""
  server = make_server(pool=write_pool(tmp_path, pool(bob=", checkpoint_roots: [bob]")))
  path = tmp_path / "bob" / "deep"
  with controller(server, BOB) as ctl:
    client = ctl.checkpoint_client()
    client.open(0, str(path.parent), ram_steps=1, ram_budget=None, sweep=False).result()
    tmp = client.send(0, Begin(str(path), 1, dcp.FORMAT)).result()
    item = dcp.Item(fqn="w", kind="bytes", nbytes=8)
    client.send(0, Stage(directory=str(path.parent), step=1, tmp_dir=tmp, final_dir=str(path),
                          leaves=[], shards=[staged(("w",), 0, (), np.zeros(8, np.uint8), rank=0)],
                          last=True,
                          extra=dcp.DcpPart(0, 1))).result()
    sums = client.send(0, Prepared(str(path), 30), timeout=30).result()
    _, size = dcp.layout(0, [item])
    refused(sidecar.InvalidArgumentError, "nested too deeply", lambda: client.send(
        0, Commit(tmp_dir=tmp, step=1, num_hosts=1, leaves=[], shards=sums, data_state_json="",
                  whole_step=True, replicas=None,
                  extra=dcp.DcpCommit(b"\x80\x04N.", {0: size}, "[" * 100_000 + "]" * 100_000)),
        timeout=10).result())
    assert not path.exists()
    client.send(0, Abort(tmp, str(path)), timeout=10).result()
