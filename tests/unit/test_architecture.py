"""ARCHITECTURE.md's references resolve: every file or folder it names in backquotes exists
(paths under sidecar/_src/ unless they start at the repository's root), and every
``module.Name`` it names with a path is defined there."""

import ast
import pathlib
import re

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

TEXT = (ROOT / "ARCHITECTURE.md").read_text()
SRC = ROOT / "sidecar" / "_src"
# `controller/checkpoint/save.py`, `server/`, `ckptfmt/orbax/write.py`, `tests/unit/...`
PATH = re.compile(r"`([a-z_0-9]+(?:/[a-z_0-9.]+)*/(?:[a-z_0-9]+\.(?:py|proto|md))?)`")
# `save.SaveProtocol`, `controller/checkpoint/save.SaveProtocol` (a module, then a name)
NAMED = re.compile(r"`((?:[a-z_0-9]+/)*[a-z_0-9]+)\.([A-Z][A-Za-z0-9]*)`")


def _where(ref: str) -> pathlib.Path | None:
  for base in (SRC, ROOT):
    if (base / ref).exists():
      return base / ref
  return None


def test_every_path_it_names_exists():
  refs = set(PATH.findall(TEXT))
  assert len(refs) > 40  # the pattern sees the document's paths
  missing = sorted(r for r in refs if _where(r) is None)
  assert missing == [], "ARCHITECTURE.md names paths that do not exist"


def _defined(path: pathlib.Path) -> set[str]:
  tree = ast.parse(path.read_text())
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    elif isinstance(node, ast.ImportFrom):
      names |= {a.asname or a.name for a in node.names}
  return names


def test_every_class_it_names_with_its_module_is_defined_there():
  checked, missing = 0, []
  for module, name in set(NAMED.findall(TEXT)):
    candidates = [p for p in SRC.rglob(f"{module.rsplit('/', 1)[-1]}.py")
                  if p.as_posix().endswith(f"/{module}.py")]
    if not candidates:
      continue  # a library's (`ocp.CheckpointManager`), not ours
    checked += 1
    if not any(name in _defined(p) for p in candidates):
      missing.append(f"{module}.{name}")
  assert checked > 15
  assert missing == [], "ARCHITECTURE.md names classes its modules do not define"
