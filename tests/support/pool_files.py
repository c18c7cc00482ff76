"""A small pool file of two tenants for the in-process tests of a pool (issue 37): its
tokens, its text, and a Controller of one tenant."""

import os

import sidecar

ALICE, BOB = "token-of-alice", "token-of-bob"
# The pool's operator token (no tenant's): write_pool writes it as operator.token, which a
# pool file names with OPERATOR_LINE.
OPERATOR = "token-of-the-operator"
OPERATOR_LINE = "operator_token_file: operator.token\n"

POOL = """\
tenants:
  - name: alice
    token_file: alice.token
    arena_ceiling: 3MiB
    sessions: 8
    checkpoint_roots: [alice]
  - name: bob
    token_file: bob.token
    arena: 4MiB
    functions: [add, echo, slow_count]
    checkpoint_roots: [bob]
"""

# Issue 54, item 3's fetched tickets: room for floods of 1,100 handshakes within each
# tenant's sessions quota, so that a holder (max_sessions_per_client) is what bounds each.
ROOMY_POOL = """\
tenants:
  - name: alice
    token_file: alice.token
    sessions: 64
    checkpoint_roots: [alice]
  - name: bob
    token_file: bob.token
    sessions: 64
    checkpoint_roots: [bob]
"""


def write_pool(directory, text: str = POOL) -> str:
  """``text`` as ``directory``/pool.yaml beside the two tenants' token files and their
  checkpoint roots, and the operator's token file, each readable by its owner only; the
  pool file's path."""
  for name, token in (("alice", ALICE), ("bob", BOB), ("operator", OPERATOR)):
    (directory / f"{name}.token").write_text(token + "\n")
    os.chmod(directory / f"{name}.token", 0o600)
  for name in ("alice", "bob"):
    (directory / name).mkdir(exist_ok=True)
  path = directory / "pool.yaml"
  path.write_text(text)
  os.chmod(path, 0o600)
  return str(path)


def controller(server, token, **kw):
  """A Controller of the tenant whose token is ``token``, not attached (arrays inline)."""
  kw.setdefault("attach", False)
  return sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token=token, timeout=10, **kw)
