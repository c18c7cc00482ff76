"""The pool's operator token (``operator_token_file``, or ``--operator-token-file``): read
and checked at each load as the tenants' token files are, no tenant's token and not the
peer token (issue 42 item 4, issue 45 item 5)."""

import os

import pytest

from sidecar._src.core import errors, options as options_lib
from sidecar._src.server.pool import pool_file
from sidecar._src.server.tenancy import tenants as tenants_lib

pytestmark = pytest.mark.unit

TENANTS = ("tenants:\n"
           "  - {name: alice, token_file: alice.token}\n"
           "  - {name: bob, token_file: bob.token}\n")


def _write(path, text: str) -> str:
  path.write_text(text)
  os.chmod(path, 0o600)
  return str(path)


def _pool(tmp_path, text: str) -> str:
  for name in ("alice", "bob"):
    _write(tmp_path / f"{name}.token", f"token-of-{name}\n")
  (tmp_path / "ops").mkdir(exist_ok=True)
  _write(tmp_path / "ops" / "operator.token", "token-of-the-operator\n")
  return _write(tmp_path / "pool.yaml", text)


def test_the_key_names_a_file_relative_to_the_pool_file(tmp_path):
  path = _pool(tmp_path, "operator_token_file: ops/operator.token\n" + TENANTS)
  pool = pool_file.load(path)
  assert pool.operator_token == "token-of-the-operator"
  assert pool.operator_token_file == str(tmp_path / "ops" / "operator.token")
  assert pool.operator_where == f"{path}:1"
  assert "token-of-the-operator" not in repr(pool)
  assert pool_file.operator_token_file(path) == pool.operator_token_file  # sidecar local's
  table = tenants_lib.Tokens.of(pool, "peer-secret").table
  assert table[b"Bearer token-of-the-operator"] == tenants_lib.OPERATOR
  assert tenants_lib.OPERATOR not in {t.name for t in pool.tenants}


def test_the_flag_names_it_where_the_pool_file_does_not(tmp_path):
  path = _pool(tmp_path, TENANTS)
  assert pool_file.load(path).operator_token is None  # none: no operator's view
  assert pool_file.operator_token_file(path) is None
  flag = str(tmp_path / "ops" / "operator.token")
  pool = pool_file.load(path, operator_token_file=flag)
  assert pool.operator_token == "token-of-the-operator"
  assert pool.operator_where == f"--operator-token-file {flag}"


@pytest.mark.parametrize("key, flag, match", [
    ("alice.token", None,
     r"pool.yaml:1: the operator token \(.*/alice.token\) is also the token of tenant "
     r"'alice' \(line 3\); the operator is no tenant: give it a token of its own"),
    ("ops/operator.token", "ops/operator.token",
     r"pool.yaml:1: operator_token_file is given here and by --operator-token-file .*; name "
     r"the operator's token in one place"),
    ("nowhere.token", None, r"pool.yaml:1: the operator: cannot read its token_file "
                            r".*nowhere.token"),
    ("[a, b]", None, r"pool.yaml:1: operator_token_file must be a single value"),
    (None, "bob.token", r"pool.yaml: the operator token \(--operator-token-file .*bob.token\) "
                        r"is also the token of tenant 'bob' \(line 3\)"),
], ids=["a-tenants-token", "key-and-flag", "unreadable", "not-a-path", "flag-is-bobs"])
def test_a_bad_operator_token_is_refused_naming_the_line(tmp_path, key, flag, match):
  path = _pool(tmp_path, (f"operator_token_file: {key}\n" if key else "") + TENANTS)
  with pytest.raises(errors.InvalidArgumentError, match=match):
    pool_file.load(path, operator_token_file=flag and str(tmp_path / flag))


def test_the_operator_token_may_not_be_the_peer_token(tmp_path):
  pool = pool_file.load(_pool(tmp_path, "operator_token_file: ops/operator.token\n" + TENANTS))
  pool.check_operator("another-secret")
  pool.check_operator(None)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"pool.yaml:1: the operator token \(.*operator.token\) is the "
                           r"sidecars' peer token \(--peer-token-file or SIDECAR_PEER_TOKEN\)"):
    pool.check_operator("token-of-the-operator")


def test_no_worker_attaches_with_the_operator_token(tmp_path):
  tenancy = tenants_lib.Tenancy(pool_file.load(
      _pool(tmp_path, "operator_token_file: ops/operator.token\n" + TENANTS)))
  assert tenancy.worker_tenant("token-of-bob") == "bob"
  with pytest.raises(errors.AuthenticationError,
                     match=r"this is the pool's operator token \(.*pool.yaml:1\): .* no worker "
                           "attaches with it"):
    tenancy.worker_tenant("token-of-the-operator")


def test_the_flag_is_a_pools_only(tmp_path):
  with pytest.raises(ValueError, match=r"an operator token \(--operator-token-file\) is a "
                                       r"pool's: give it with --pool FILE"):
    options_lib.ServerOptions(token="t" * 16, operator_token_file=str(tmp_path / "x"))
