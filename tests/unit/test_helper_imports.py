"""Helpers shared by tests and benchmarks live in tests/support/: no module imports a test
module (a benchmark that did ran the test module's imports and fixtures, and broke when a
test moved)."""

import ast

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.unit


def _imports_of_test_modules(path) -> list[str]:
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    names = ([a.name for a in node.names] if isinstance(node, ast.Import)
             else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
             else [])
    found += [n for n in names
              if n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_")]
  return found


def test_no_benchmark_or_test_imports_a_test_module():
  files = sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
  bad = {str(p.relative_to(ROOT)): names for p in files
         if (names := _imports_of_test_modules(p))}
  assert not bad, f"move what these import into tests/support/: {bad}"
