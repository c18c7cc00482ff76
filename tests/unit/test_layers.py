"""Import layers as a test: each module's imports read with ``ast``, none executed.

Each package of ``sidecar/_src`` is one subsystem, and imports only from itself and the
packages below it (``LAYERS``, lowest first; ARCHITECTURE.md's "Layout" draws them):

- ``core``: errors, options, env, logs, interrupts (the standard library only), dtypes (numpy's);
- ``ckptfmt``: stock Orbax's layout on disk, on core only (no RPC, no framework);
- ``wire``: the protocol (the only importer of the generated code), codec, ipc;
- ``arena``: shared memory and the Worker that maps it in a trainer process;
- ``streams``: the one stream consumer and its gRPC and Unix-socket transports;
- ``user``: what registered code imports;
- ``server``: the sidecar process; ``controller``: the trainer's client, framework-neutral
  (a Framework adapter interface, ``controller/framework.py``). They never import each
  other: the process boundary;
- ``jax`` (and later ``torch``): the framework adapters over the controller core;
- ``tools``: the command line, LocalCluster, launch, k8s.

Nothing below the adapters imports a framework (a PyTorch trainer has no JAX); the
sidecar may load one where a registered function, a feed or a checkpoint needs it, never
at its start but for its checkpoint formats' libraries where it serves checkpoints
(``ckptfmt/orbax/libs.py``: once, on its main thread, before it serves). The pipelines
are written against the public API, as a user's would be.
"""

import ast
import functools
import pathlib
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

PACKAGES = ("sidecar", "pipelines")
GENERATED = "sidecar.v1"


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _is_under(name: str, prefix: str) -> bool:
  return name == prefix or name.startswith(prefix + ".")


def _sources() -> dict[str, pathlib.Path]:
  found = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      name = _module_name(path)
      if not _is_under(name, GENERATED):
        found[name] = path
  return found


SOURCES = _sources()
GENERATED_MODULES = {_module_name(p) for p in (ROOT / "sidecar" / "v1").glob("*.py")}
KNOWN = set(SOURCES) | GENERATED_MODULES


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
  if not node.level:
    return node.module or ""
  base = module.split(".")[:len(module.split(".")) - node.level + is_package]
  return ".".join(base + ([node.module] if node.module else []))


def _names(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
  """The modules an import statement names: ``from a import b`` is ``a.b`` if that is one."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  base = _resolve(module, node, module in SOURCES and SOURCES[module].name == "__init__.py")
  return [f"{base}.{a.name}" if f"{base}.{a.name}" in KNOWN else base for a in node.names]


def _walk_import_time(body: list[ast.stmt], *, typing: bool = True):
  """The statements that run when the module is imported: not those inside functions (nor,
  without ``typing``, those under ``if TYPE_CHECKING:``)."""
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    if not typing and isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
      yield from _walk_import_time(node.orelse, typing=typing)
      continue
    yield node
    for field in ("body", "orelse", "finalbody", "handlers"):
      yield from _walk_import_time(getattr(node, field, []), typing=typing)


@functools.cache
def _parsed(module: str) -> ast.Module:
  """``module``'s tree, parsed once for the file's tests (each read every module's imports,
  some many times over; nothing changes a tree)."""
  return ast.parse(SOURCES[module].read_text())


def _imports(module: str, *, import_time_only: bool = False, source: str | None = None,
             typing: bool = True) -> set[str]:
  tree = _parsed(module) if source is None else ast.parse(source)
  nodes = _walk_import_time(tree.body, typing=typing) if import_time_only else ast.walk(tree)
  return {name for node in nodes if isinstance(node, (ast.Import, ast.ImportFrom))
          for name in _names(module, node)}


def _violations(modules, forbidden: str) -> dict[str, list[str]]:
  out = {}
  for m in modules:
    bad = sorted(n for n in _imports(m) if _is_under(n, forbidden))
    if bad:
      out[m] = bad
  return out


def _under(prefix: str) -> list[str]:
  return [m for m in SOURCES if _is_under(m, prefix)]


def test_the_parser_sees_the_modules_and_their_imports():
  # Guards the tests below against passing on nothing.
  assert {"sidecar._src.server.server", "sidecar._src.controller.controller",
          "sidecar._src.arena.worker", "pipelines.tfds"} <= set(SOURCES)
  assert len(_under("sidecar._src.server")) >= 8 and len(_under("sidecar._src.controller")) >= 8
  assert "sidecar._src.server.calls.calls" in _imports("sidecar._src.server.server")
  assert "sidecar.v1.sidecar_pb2" in _imports("sidecar._src.wire.protocol")
  snippet = "try:\n  import a\nexcept ImportError:\n  import b\ndef f():\n  import c\n"
  assert _imports("x", source=snippet) == {"a", "b", "c"}
  assert _imports("x", source=snippet, import_time_only=True) == {"a", "b"}


# The packages of sidecar/_src, lowest layer first, each with the packages it may import.
# ARCHITECTURE.md draws the same picture.
LAYERS = {
    "core": set(),
    "ckptfmt": {"core"},
    "wire": {"core", "ckptfmt"},
    "arena": {"core", "wire"},
    "streams": {"core", "wire", "arena"},
    "user": {"core", "wire"},
    "server": {"core", "ckptfmt", "wire", "arena", "streams", "user"},
    "controller": {"core", "ckptfmt", "wire", "arena", "streams", "user"},
    "jax": {"core", "ckptfmt", "wire", "arena", "streams", "user", "controller"},
    "torch": {"core", "ckptfmt", "wire", "arena", "streams", "user", "controller"},
    "tools": {"core", "ckptfmt", "wire", "arena", "streams", "user", "server", "controller",
              "jax", "torch"},
}
# Frameworks a trainer may not have (a PyTorch trainer has no JAX): only the jax/ adapter and
# the tools import them, and ckptfmt (the stock-Orbax format) Orbax's and TensorStore's own,
# never at its import (LAZY_ONLY): the registry imports every format.
FRAMEWORKS = ("jax", "jaxlib", "orbax", "tensorstore", "grain", "torch")
# The torch/ adapter imports torch only: a PyTorch trainer loads no JAX.
MAY_IMPORT_FRAMEWORKS = {"jax": FRAMEWORKS, "tools": FRAMEWORKS, "torch": ("torch",),
                         "ckptfmt": ("orbax", "tensorstore")}
LAZY_ONLY = ("server", "ckptfmt")
# What the layout still breaks while the architecture issue is in progress. Each entry goes
# when its module is fixed (the test fails on an entry that no longer applies).
KNOWN_VIOLATIONS = {
}


def _package(module: str) -> str | None:
  parts = module.split(".")
  return parts[2] if len(parts) > 2 and parts[:2] == ["sidecar", "_src"] else None


def _layer_violations(module: str) -> list[str]:
  """The imports of ``module`` its layer does not allow.

  The sidecar (``server``) may import a framework where a registered function, a feed or a
  checkpoint needs it, never at its start: a lean sidecar starts in a fraction of a second.
  """
  pkg = _package(module)
  at_start = _imports(module, import_time_only=True)
  run_at_start = _imports(module, import_time_only=True, typing=False)
  bad = []
  for name in sorted(_imports(module)):
    other = _package(name)
    if other in LAYERS and other != pkg and other not in LAYERS[pkg]:
      bad.append(name)
    top = name.split(".")[0]
    if (top in FRAMEWORKS and top not in MAY_IMPORT_FRAMEWORKS.get(pkg, ())
        and (pkg != "server" or name in at_start)):
      bad.append(name)
    elif top in FRAMEWORKS and pkg in LAZY_ONLY and name in run_at_start:
      bad.append(f"{name} (at import)")
  return bad


def test_every_package_of_src_has_a_layer():
  assert {_package(m) for m in SOURCES if _package(m)} == set(LAYERS)


@pytest.mark.parametrize("pkg", list(LAYERS))
def test_each_package_imports_only_the_layers_below_it(pkg):
  found = {m: bad for m in _under(f"sidecar._src.{pkg}") if (bad := _layer_violations(m))}
  known = {m: v for m, v in KNOWN_VIOLATIONS.items() if _package(m) == pkg}
  assert found == known, "a module imports what its layer does not allow, or a known " \
      "violation is fixed: remove it from KNOWN_VIOLATIONS"


def test_the_layer_check_sees_a_violation(tmp_path):
  # Guards the test above against passing on nothing.
  probe = tmp_path / "probe.py"
  probe.write_text("import jax\nfrom sidecar._src.server.calls import calls\n"
                   "from sidecar._src.core import errors\ndef f():\n  import torch\n")
  for pkg, bad in [("controller", ["jax", "sidecar._src.server.calls.calls", "torch"]),
                   ("server", ["jax"]), ("tools", [])]:
    module = f"sidecar._src.{pkg}.probe"
    SOURCES[module] = probe
    try:
      assert _layer_violations(module) == bad
    finally:
      del SOURCES[module]


@pytest.mark.parametrize("side, other", [
    ("sidecar._src.server", "sidecar._src.controller"),
    ("sidecar._src.controller", "sidecar._src.server"),
], ids=["server-imports-no-controller", "controller-imports-no-server"])
def test_server_and_controller_never_import_each_other(side, other):
  assert _violations(_under(side), other) == {}


def test_the_pool_holds_the_checkpoint_store_and_the_call_runner_through_policies():
  # A pool's quotas are policy objects (server/policies.py) handed to the checkpoint store
  # and the call runner when they are made: neither imports the pool, and the pool imports
  # neither (so it subclasses neither); the policies' seam imports none of the three.
  pool = _under("sidecar._src.server.pool")
  held = ["sidecar._src.server.calls.calls", *_under("sidecar._src.server.checkpoint")]
  assert "sidecar._src.server.pool.tenant_checks" in pool and len(held) > 8
  assert "sidecar._src.server.policies" in _imports("sidecar._src.server.pool.tenant_checks")
  assert _violations(held, "sidecar._src.server.pool") == {}
  for part in ("sidecar._src.server.calls", "sidecar._src.server.checkpoint"):
    assert _violations(pool, part) == {}
    assert _violations(["sidecar._src.server.policies"], part) == {}
  assert _violations(["sidecar._src.server.policies"], "sidecar._src.server.pool") == {}


def test_the_stream_consumer_sits_below_both_of_its_transports():
  # The gRPC and the worker-socket transports implement its Transport: it imports neither.
  consumer = "sidecar._src.streams.consumer"
  assert _violations([consumer], "sidecar._src.streams.grpc_transport") == {}
  assert consumer in _imports("sidecar._src.streams.grpc_transport")


@pytest.mark.parametrize("module", ["sidecar._src.core.errors", "sidecar._src.core.platform",
                                    "sidecar._src.core.stall"])
def test_leaves_import_only_the_standard_library(module):
  outside = sorted(n for n in _imports(module)
                   if n.split(".")[0] not in sys.stdlib_module_names | {"__future__"})
  assert outside == []


def test_env_imports_only_the_standard_library_and_errors():
  # The one table of environment variables: every layer reads through it, so it sits
  # beside the leaves, with errors.py for the messages it raises.
  outside = sorted(n for n in _imports("sidecar._src.core.env")
                   if n.split(".")[0] not in sys.stdlib_module_names | {"__future__"})
  assert outside == ["sidecar._src.core.errors"]


@pytest.mark.parametrize("module, allowed", [
    ("sidecar._src.core.address", ["sidecar._src.core.errors"]),
    ("sidecar._src.core.options", ["sidecar._src.core.address", "sidecar._src.core.stall"]),
], ids=["address", "options"])
def test_address_and_options_sit_just_above_the_leaves(module, allowed):
  # The one parser of a sidecar address raises our errors; options read a listen address
  # with it, and check the stall timeout with the stall rule's leaf. Both stay on the
  # standard library otherwise.
  outside = sorted(n for n in _imports(module)
                   if n.split(".")[0] not in sys.stdlib_module_names | {"__future__"})
  assert outside == allowed


def test_only_protocol_imports_the_generated_code():
  assert set(_violations(SOURCES, GENERATED)) == {"sidecar._src.wire.protocol"}


def test_pipelines_use_only_the_public_api():
  assert _violations(_under("pipelines"), "sidecar._src") == {}


def _import_time_closure(start: str) -> set[str]:
  """The project modules loaded by importing ``start``, with their parent packages.

  The ``sidecar`` package itself is left out: its ``__init__`` is the public API,
  which loads every layer for the user.
  """
  seen, todo = set(), [start]
  while todo:
    m = todo.pop()
    if m in seen or m not in SOURCES:
      continue
    seen.add(m)
    parts = m.split(".")
    todo += [".".join(parts[:i]) for i in range(2, len(parts))]
    todo += [n for n in _imports(m, import_time_only=True) if n != "sidecar"]
  return seen


def test_the_sidecar_server_imports_no_controller_code():
  closure = _import_time_closure("sidecar._src.server.server")
  assert {"sidecar._src.server.calls.calls", "sidecar._src.wire.protocol"} <= closure
  assert sorted(m for m in closure if _is_under(m, "sidecar._src.controller")) == []
  # The closure does follow imports into the controller: local.py's reaches it.
  assert "sidecar._src.controller.controller" in _import_time_closure("sidecar._src.tools.local")


# ---- server/ by subsystem (issue 65, item 3) ------------------------------------------------

SERVER = "sidecar._src.server"
# The top of server/ holds the server's wiring and what every subsystem shares; the rest
# is in packages by subsystem.
MAX_TOP_MODULES = 14
MAX_LINES = 600
# Modules of server/ over MAX_LINES while their rewrite is in progress. Each entry goes when
# its module is split by what it does (the test fails on an entry that no longer applies).
KNOWN_LONG: set[str] = set()  # none since issue 65 (item 1 split checkpoint/save.py)


def _unit(module: str) -> str:
  """The part of server/ that ``module`` is in: its package, or itself at the top."""
  return ".".join(module.split(".")[:4])


def _server_imports() -> dict[str, set[str]]:
  """Each part of server/ (a package, or a module at its top), and the other parts it
  imports anywhere: at module level, inside functions, under ``TYPE_CHECKING``."""
  graph: dict[str, set[str]] = {}
  for m in _under(SERVER):
    if m == SERVER:
      continue
    found = {_unit(n) for n in _imports(m) if _is_under(n, SERVER) and n != SERVER}
    graph.setdefault(_unit(m), set()).update(found - {_unit(m)})
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle through each strongly connected part of ``graph`` with more than one node."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  out = []

  def visit(v: str) -> None:  # Tarjan's
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      part = []
      while True:
        w = stack.pop()
        part.append(w)
        if w == v:
          break
      if len(part) > 1:
        out.append(sorted(part))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_the_top_of_server_holds_its_wiring_and_what_is_shared_only():
  top = sorted(m for m in _under(SERVER)
               if m.count(".") == 3 and SOURCES[m].name != "__init__.py")
  assert "sidecar._src.server.server" in top and len(top) >= 5
  assert len(top) <= MAX_TOP_MODULES, (
      f"server/ holds {len(top)} modules at its top, at most {MAX_TOP_MODULES}: move those "
      f"of one subsystem into its package: {[m.rsplit('.', 1)[1] for m in top]}")


def test_no_module_of_server_is_over_600_lines():
  long = {m: n for m in _under(SERVER)
          if (n := len(SOURCES[m].read_text().splitlines())) > MAX_LINES}
  assert set(long) == KNOWN_LONG, (
      f"modules of server/ over {MAX_LINES} lines: {long}; split each where a reader would "
      "look (STYLE.md, 28), or remove from KNOWN_LONG one that is fixed")


def test_no_two_parts_of_server_import_each_other():
  # A part is a package of server/ or a module at its top; an import inside a function
  # counts as one at the top would: a lazy import does not break a cycle, it hides it.
  graph = _server_imports()
  assert {"sidecar._src.server.tenancy", "sidecar._src.server.pool",
          "sidecar._src.server.server"} <= set(graph)
  assert "sidecar._src.server.tenancy" in graph["sidecar._src.server.pool"]
  assert _cycles(graph) == [], "parts of server/ that import each other, directly or not"


def test_the_cycle_check_sees_a_cycle(tmp_path):
  # Guards the test above against passing on nothing: tenancy/ importing the pool in a
  # function is a cycle (the pool imports tenancy/).
  probe = tmp_path / "probe.py"
  probe.write_text("def f():\n  from sidecar._src.server.pool import pool_file\n")
  module = "sidecar._src.server.tenancy.probe"
  SOURCES[module] = probe
  try:
    assert ["sidecar._src.server.pool", "sidecar._src.server.tenancy"] in _cycles(
        _server_imports())
  finally:
    del SOURCES[module]
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
