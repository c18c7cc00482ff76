"""Shared fixtures. Every test that makes shared memory proves it is gone afterwards.

Every test has one tier, declared in one line after its module's imports:
``pytestmark = pytest.mark.unit`` (no sockets, no processes), ``pytest.mark.server`` (an
in-process gRPC sidecar) or ``pytest.mark.processes`` (sidecar, trainer or kernel processes:
LocalCluster, ``sidecar launch``, subprocesses). A test of another tier than its module's
carries its own ``@pytest.mark.<tier>``, which wins. So ``pytest -m unit`` runs in half a
minute, and ``pytest -m "not processes"`` in about a minute and a half.

Collection fails, naming the test and the fix, where a test has no tier, two on one node, or a
tier below what its code (and its fixtures' code) visibly uses: ``subprocess`` or
``LocalCluster`` needs ``processes``, ``make_server`` or ``Server`` needs ``server``. That
cross-check reads names in the code, not strings or comments, so it is a lower bound: a test
that starts processes through a helper of its module must be marked by hand.
"""

import ast
import functools
import inspect
import os
import textwrap

# Before jax starts anywhere in the test process: 8 CPU devices, CPU only.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402


def eventually(predicate, timeout: float = 5.0) -> bool:
  """Polls ``predicate`` until it holds or ``timeout`` passes; returns its last value.

  For effects that arrive through another thread or process (a block freed, say).
  """
  import time
  deadline = time.monotonic() + timeout
  while not predicate() and time.monotonic() < deadline:
    time.sleep(0.01)
  return bool(predicate())


def alive(pid: int) -> bool:
  """Whether process ``pid`` runs: a zombie has exited (only its parent can reap it)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def shm_entries() -> set[str]:
  return {n for n in os.listdir("/dev/shm") if not n.startswith(("sem.", "lttng"))}


def _parent(pid: int) -> int:
  with open(f"/proc/{pid}/stat") as f:
    return int(f.read().rsplit(")", 1)[1].split()[1])


def _descends_from_us(pid: int) -> bool:
  """Whether ``pid`` was started by this test process (or its children)."""
  try:
    while pid > 1:
      pid = _parent(pid)
      if pid == os.getpid():
        return True
  except OSError:
    pass
  return False


def arena_mappers() -> list[int]:
  """Pids of processes this test process started that still map a sidecar arena memfd.

  Other processes on the machine (another test run, say) are not this run's business.
  """
  pids = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid() or not _descends_from_us(int(pid)):
      continue
    try:
      with open(f"/proc/{pid}/maps") as f:
        if "memfd:sidecar-arena" in f.read():
          pids.append(int(pid))
    except OSError:
      continue
  return pids


@pytest.fixture(autouse=True)
def root_logging_restored():
  """The root logger as it was before the test: ``cli.main`` configures logging for the
  process (``logs.configure``), with a handler on the test's captured stderr, which is
  closed once the test ends; a daemon thread's late record would then fail to write."""
  import logging
  root = logging.getLogger()
  handlers, level = root.handlers[:], root.level
  yield
  root.handlers[:] = handlers
  root.setLevel(level)


@pytest.fixture(autouse=True)
def no_shm_leak():
  before = shm_entries()
  yield
  assert shm_entries() - before == set(), "a test left segments in /dev/shm"


@pytest.fixture
def registry():
  """A fresh default registry for the test, restored afterwards."""
  import sidecar
  fresh = sidecar.Registry()
  previous = sidecar.set_default_registry(fresh)
  yield fresh
  sidecar.set_default_registry(previous)


PEER_TOKEN = "test-peer-token"  # what make_server's sidecars present to each other


@pytest.fixture
def make_server(tmp_path):
  """Starts in-process sidecar servers on loopback with the test functions registered."""
  import tempfile

  import sidecar
  from sidecar._src.core import options
  from sidecar._src.host.server import Server
  from sidecar._src.user import registry as registry_lib
  from tests.support import sidecar_fns  # noqa: F401  (registers into the default registry)

  servers = []

  def make(**kw):
    reg = kw.pop("registry", None)
    if reg is None:
      reg = registry_lib.Registry()
      for entry in sidecar.default_registry():
        if entry.fn.__module__ == "tests.support.sidecar_fns":
          reg.add(entry.kind, entry.name, entry.fn)
    kw.setdefault("shm_size", 8 << 20)
    kw.setdefault("checkpoint_roots", (str(tmp_path), tempfile.gettempdir()))
    kw.setdefault("peer_token", PEER_TOKEN)  # the servers of one test are one job's peers
    opts = options.ServerOptions(listen="127.0.0.1", port=0, health_port=0,
                                 socket_path=str(tmp_path / f"s{len(servers)}.sock"), **kw)
    server = Server(opts, registry=reg).start()
    servers.append(server)
    return server

  yield make
  for s in servers:
    s.stop(grace=0)


TIERS = ("unit", "server", "processes")  # each tier may do what the ones before it do
_MARK_IT = ("`pytestmark = pytest.mark.unit` (no sockets, no processes), `pytest.mark.server` "
            "(an in-process gRPC sidecar) or `pytest.mark.processes` (LocalCluster, "
            "subprocesses)")
# Names whose use in a test or its fixtures shows the tier it needs at least.
_STARTS_PROCESSES = frozenset({"LocalCluster", "subprocess", "Popen", "multiprocessing",
                               "KernelManager", "nbclient", "launch.run"})
_STARTS_A_SERVER = frozenset({"make_server", "Server", "grpc.server"})


def _declared_tiers(item) -> list[str]:
  """The tier markers nearest the test: its own win over its class's, which win over its
  module's. One, unless a marker is missing (none) or doubled (several)."""
  for node in item.iter_parents():
    if tiers := sorted({m.name for m in node.own_markers if m.name in TIERS}, key=TIERS.index):
      return tiers
  return []


@functools.cache
def _names(fn) -> frozenset[str]:
  """The names ``fn``'s code uses, dotted as written (``subprocess.run`` gives both
  ``subprocess`` and ``subprocess.run``): strings, comments and docstrings don't count."""
  try:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
  except (OSError, TypeError, SyntaxError):
    return frozenset()
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name):
      names.add(node.id)
    elif isinstance(node, ast.Attribute):
      names.add(node.attr)
      if isinstance(node.value, ast.Name):
        names.add(f"{node.value.id}.{node.attr}")
    elif isinstance(node, ast.alias):
      names.update(node.name.split("."))
  return frozenset(names)


def _visible_tier(item) -> tuple[str, set[str]]:
  """The tier that the test's code and its fixtures' code visibly need, and the names why.

  A lower bound: a test may start processes through a helper this cannot see.
  """
  fns = [item.function, *(d.func for defs in item._fixtureinfo.name2fixturedefs.values()
                          for d in defs)]
  names = set(item.fixturenames).union(*map(_names, fns))
  if why := names & _STARTS_PROCESSES:
    return "processes", why
  if why := names & _STARTS_A_SERVER:
    return "server", why
  return "unit", set()


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by these markers
def pytest_collection_modifyitems(config, items):
  problems, tiers = [], {}
  for item in items:
    if not isinstance(item, pytest.Function):
      continue
    match _declared_tiers(item):
      case []:
        module = item.nodeid.split("::")[0]
        problems.append(f"{module} has a test with no tier marker: put {_MARK_IT} in one line "
                        f"after the imports of {module}, or mark the test itself")
      case [tier]:
        needs, why = _visible_tier(item)
        if TIERS.index(needs) > TIERS.index(tier):
          problems.append(f"{item.nodeid} is marked {tier} but uses {', '.join(sorted(why))}: "
                          f"mark it `@pytest.mark.{needs}`")
        tiers[item] = tier
      case several:
        problems.append(f"{item.nodeid} has the tier markers {' and '.join(several)} on one "
                        f"node: keep the one it needs")
  if problems:
    raise pytest.UsageError("test tiers:\n  " + "\n  ".join(dict.fromkeys(problems)))
  # Each item then holds its one tier itself, so that ``-m`` sees that and not the module's.
  for item, tier in tiers.items():
    for node in item.iter_parents():
      node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]
    item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session", autouse=True)
def no_process_left_mapping_an_arena():
  """After the whole run: no process this run started still maps a sidecar arena.

  A memfd arena never appears in /dev/shm, so ``no_shm_leak`` cannot see it.
  """
  yield
  assert eventually(lambda: not arena_mappers(), timeout=10), (
      f"processes this test run started still map an arena: {arena_mappers()}")
