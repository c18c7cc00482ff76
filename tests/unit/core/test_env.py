"""env.py's table is the whole list of ``SIDECAR_*`` variables, and only it reads them.

Tier 1: source files read with ``re`` and ``ast``, nothing started.
"""

import ast
import pathlib
import re

import pytest

from sidecar._src.core import env as env_lib, errors
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

SOURCES = sorted(p for d in ("sidecar", "pipelines") for p in (ROOT / d).rglob("*.py")
                 if "v1" not in p.relative_to(ROOT).parts)


def _rel(path: pathlib.Path) -> str:
  return str(path.relative_to(ROOT))


def test_every_sidecar_name_in_the_code_is_in_the_table():
  found = {}
  for path in SOURCES:
    for name in re.findall(r"SIDECAR_[A-Z_]*[A-Z]", path.read_text()):
      found.setdefault(name, _rel(path))
  assert len(found) > 30  # the scan sees them
  missing = {n: where for n, where in found.items() if n not in env_lib.VARS}
  assert missing == {}, "add these to sidecar/_src/core/env.py's table"


def test_every_row_says_what_it_means_its_default_and_who_reads_it():
  for v in env_lib.VARS.values():
    assert v.name.startswith("SIDECAR_") and v.meaning and v.default and v.readers, v
  assert {getattr(env_lib, c) for c in dir(env_lib)
          if c.isupper() and isinstance(getattr(env_lib, c), str)
          and getattr(env_lib, c).startswith("SIDECAR_")} == set(env_lib.VARS)
  assert set(env_lib.DESCRIPTIONS) == {v.name for v in env_lib.VARS.values() if v.launcher}
  assert (env_lib.COORDINATOR_ADDRESS in env_lib.DESCRIPTIONS
          and env_lib.PEER_TIMEOUT not in env_lib.DESCRIPTIONS)
  assert "SIDECAR_SHM_SIZE\n  --shm-size: the arena's size, e.g. 4GiB\n  default: 1GiB\n" \
      in env_lib.table()


def _environ_reads(tree: ast.AST):
  """The first argument of each ``os.environ.get(X)``, ``os.environ[X]``, ``os.getenv(X)``."""
  def is_environ(node):
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")
  for node in ast.walk(tree):
    if isinstance(node, ast.Subscript) and is_environ(node.value):
      yield node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
        (node.func.attr == "get" and is_environ(node.func.value))
        or (node.func.attr == "getenv" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "os")):
      yield node.args[0]


def test_only_env_py_reads_sidecar_variables_from_the_environment():
  bad = {}
  for path in SOURCES:
    rel = _rel(path)
    if rel == "sidecar/_src/core/env.py":
      continue
    for arg in _environ_reads(ast.parse(path.read_text())):
      # Another program's variable by its literal name (XLA_FLAGS) is fine; anything
      # else could be ours under a constant's name.
      if not (isinstance(arg, ast.Constant) and not str(arg.value).startswith("SIDECAR_")):
        bad.setdefault(rel, []).append(ast.unparse(arg))
  assert bad == {}, "read these through sidecar._src.core.env.get"


def test_get_refuses_a_name_not_in_the_table_and_treats_empty_as_unset():
  with pytest.raises(KeyError, match=r"'SIDECAR_NOPE' is not in sidecar/_src/core/env.py's table"):
    env_lib.get("SIDECAR_NOPE", environ={})
  assert env_lib.get(env_lib.PORT, "8490", environ={env_lib.PORT: ""}) == "8490"
  assert env_lib.get(env_lib.PORT, environ={env_lib.PORT: "9"}) == "9"
  with pytest.raises(KeyError, match="not in sidecar/_src/core/env.py's table"):
    env_lib.int_var({}, "SIDECAR_NOPE", 1, minimum=0)


def test_token_prefers_the_file_given_then_the_variable_then_its_file(tmp_path):
  f = tmp_path / "token"
  f.write_text("from-file\n")
  assert env_lib.token(environ={}) is None
  assert env_lib.token(environ={env_lib.TOKEN: "t"}) == "t"
  assert env_lib.token(environ={env_lib.TOKEN_FILE: str(f)}) == "from-file"
  assert env_lib.token(str(f), environ={env_lib.TOKEN: "t"}) == "from-file"
  f.write_text("  \n")
  with pytest.raises(errors.InvalidArgumentError, match=r"token file .* is empty; put the token"):
    env_lib.token(str(f), environ={})
