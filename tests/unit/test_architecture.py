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


# ---- the Layout block: every folder's modules, both ways ----------------------------------

LAYOUT = TEXT.split("\n## Layout\n", 1)[1].split("```")[1]
CONTINUED = " " * 24  # a description's next line
CHECKED = ("sidecar/", "pipelines/")  # both ways; benchmarks/: the names listed exist


def _layout() -> dict[str, list[str]]:
  """``{folder: the modules its line lists}``: the words after the first colon, commas
  between, with what is in parentheses dropped."""
  texts: dict[str, str] = {}
  parents: dict[int, str] = {}
  folder = None
  for line in LAYOUT.strip("\n").splitlines():
    if line.startswith(CONTINUED) and folder is not None:
      texts[folder] += " " + line.strip()
      continue
    m = re.match(r"( *)(\S+/)(?:\s+(.*))?$", line)
    assert m, f"a Layout line is neither a folder nor a continuation: {line!r}"
    depth = len(m.group(1))
    folder = parents.get(depth - 2, "") + m.group(2)
    parents[depth] = folder
    texts[folder] = m.group(3) or ""
  out = {}
  for folder, text in texts.items():
    while (bare := re.sub(r"\([^()]*\)", "", text)) != text:
      text = bare
    _, colon, names = text.partition(": ")
    out[folder] = [n.strip() for n in names.split(",")] if colon else []
  return out


def test_the_layout_lists_every_module_of_each_folder_and_no_other():
  layout = _layout()
  assert {"sidecar/", "sidecar/_src/core/", "sidecar/_src/ckptfmt/orbax/",
          "sidecar/_src/tools/k8s/", "pipelines/", "benchmarks/"} <= set(layout)
  wrong = {}
  for folder, names in layout.items():
    if not folder.startswith(CHECKED) or folder == "sidecar/_src/":
      continue
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", n)]
    assert bad == [], f"{folder}: after its colon, module names only, commas between: {bad}"
    there = {p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
    if set(names) != there:
      wrong[folder] = {"named, not there": sorted(set(names) - there),
                       "there, not named": sorted(there - set(names))}
  assert wrong == {}, "ARCHITECTURE.md's Layout has drifted from the code"
  packages = {p.parent.relative_to(ROOT).as_posix() + "/"
              for p in SRC.rglob("__init__.py") if p.parent != SRC}
  assert sorted(packages - set(layout)) == [], "packages with no Layout line"
  missing = [n for n in layout["benchmarks/"] if not (ROOT / "benchmarks" / f"{n}.py").exists()]
  assert missing == []
