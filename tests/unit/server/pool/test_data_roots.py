"""The pool file's ``data_roots``: where each tenant's pipelines may read, checked apart from
the other tenants' data and checkpoints when the file is read."""

import os

import pytest

from sidecar._src.core import errors
from sidecar._src.server.pool import pool_file
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.user import data_roots

pytestmark = pytest.mark.unit


def _load(tmp_path, *tenants: str) -> tenants_lib.Pool:
  lines = []
  for i, entry in enumerate(tenants):
    name = ("alice", "bob", "carol")[i]
    (tmp_path / f"{name}.token").write_text(f"token-of-{name}\n")
    os.chmod(tmp_path / f"{name}.token", 0o600)
    lines.append(f"  - {{name: {name}, token_file: {name}.token{', ' if entry else ''}{entry}}}\n")
  path = tmp_path / "pool.yaml"
  path.write_text("tenants:\n" + "".join(lines))
  os.chmod(path, 0o600)
  return pool_file.load(str(path))


def test_data_roots_default_to_the_checkpoint_roots_and_else_to_none(tmp_path):
  pool = _load(tmp_path, "checkpoint_roots: [ck/alice], data_roots: [data/alice, /shared]",
               "checkpoint_roots: [ck/bob]", "")
  alice, bob, carol = pool.tenants
  real = os.path.realpath(tmp_path)
  assert alice.data_roots == (f"{real}/data/alice", "/shared")
  assert bob.data_roots == (f"{real}/ck/bob",)
  assert carol.data_roots == ()
  roots = pool.data_roots("bob")
  assert roots == data_roots.DataRoots(roots=(f"{real}/ck/bob",), tenant="bob",
                                       where=f"{tmp_path}/pool.yaml:3",
                                       open_files=roots.open_files,
                                       open_files_why=roots.open_files_why)
  assert roots.open_files is not None  # its share of the sidecar's descriptors
  assert pool.data_roots("carol").roots == () and pool.data_roots(None).roots == ()
  # Outside a pool file (one shared token, per-client tokens): anywhere, as before.
  assert tenants_lib.Pool.shared("t").data_roots("") is data_roots.ANYWHERE
  assert tenants_lib.Pool.clients((("a", "t"),)).data_roots("a") is data_roots.ANYWHERE


@pytest.mark.parametrize(("alice", "bob", "match"), [
    ("checkpoint_roots: [ck/alice]", "data_roots: [ck]",
     r"tenant 'bob'.s data root \S+/ck overlaps tenant 'alice'.s checkpoint root \S+/ck/alice"),
    ("checkpoint_roots: [ck/alice]", "data_roots: [ck/alice/corpus]",
     r"tenant 'bob'.s data root \S+/ck/alice/corpus overlaps tenant 'alice'.s checkpoint root "
     r"\S+/ck/alice"),
    ("checkpoint_roots: [ck/alice]", "checkpoint_roots: [ck/bob], data_roots: [ck/alice]",
     r"tenant 'bob'.s data root \S+/ck/alice is tenant 'alice'.s checkpoint root \S+/ck/alice"),
    ("data_roots: [data]", "data_roots: [data/bob]",
     r"tenant 'bob'.s data root \S+/data/bob overlaps tenant 'alice'.s data root \S+/data"),
    ("data_roots: [/data]", "checkpoint_roots: [/data/bob]",  # his data root, by default
     r"tenant 'bob'.s data root /data/bob overlaps tenant 'alice'.s data root /data"),
], ids=["holds-her-checkpoints", "in-her-checkpoints", "is-her-checkpoints", "in-her-data",
        "his-checkpoints-in-her-data"])
def test_a_data_root_that_reaches_another_tenants_data_is_refused(tmp_path, alice, bob, match):
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:3: " + match + r" \(line 2\); a tenant's pipelines read "
                     "everything beneath its data roots: give each tenant data roots of its own"):
    _load(tmp_path, alice, bob)


def test_a_data_root_above_a_later_tenants_checkpoints_is_named_with_its_line(tmp_path):
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:3: tenant 'alice'.s data root /data \(line 2\) overlaps "
                     r"tenant 'bob'.s checkpoint root /data/bob; "):
    _load(tmp_path, "data_roots: [/data]", "checkpoint_roots: [/data/bob], data_roots: [/b]")


def test_the_very_same_data_root_is_shared_data(tmp_path):
  pool = _load(tmp_path, "data_roots: [/datasets/public]", "data_roots: [/datasets/public]")
  assert pool.tenants[0].data_roots == pool.tenants[1].data_roots == ("/datasets/public",)


def test_a_data_root_in_the_sidecars_checkpoint_root_must_be_the_tenants_own(tmp_path):
  ok = _load(tmp_path, "checkpoint_roots: [ck/alice], data_roots: [ck/alice/data, /data/a]")
  ok.check_roots((str(tmp_path / "ck"),))
  pool = _load(tmp_path, "checkpoint_roots: [ck/alice], data_roots: [ck/shared]")
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:2: tenant 'alice': data root \S+/ck/shared overlaps the "
                     r"sidecar's --checkpoint-root \S+/ck, where other tenants' checkpoints may "
                     "be"):
    pool.check_roots((str(tmp_path / "ck"),))
