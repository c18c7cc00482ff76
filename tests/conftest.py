"""Shared fixtures. Every test that makes shared memory proves it is gone afterwards.

Every test has one tier, and its folder says which: ``tests/unit`` (no sockets, no
processes), ``tests/server`` (an in-process gRPC sidecar), ``tests/processes`` (sidecar,
trainer or kernel processes: LocalCluster, ``sidecar launch``, subprocesses), each mirroring
``sidecar/_src``. A module declares its folder's tier in one line after its imports,
``pytestmark = pytest.mark.unit`` (``server``, ``processes``), so that ``pytest -m unit`` runs
in half a minute and ``pytest -m "not processes"`` in about a minute and a half.
``tests/accelerator`` (``accelerator``) needs the machine's TPU or GPU and runs alone, never
in CI nor under the default command (``testpaths``): tests/accelerator/conftest.py.

Collection fails, naming the test and the fix, where a module declares no tier, two, or
another than its folder's; where a test or class carries a tier marker of its own (a test of
another tier goes to a module of the same subject in that tier's folder); where a test module
is in no tier's folder; and where a test's tier is below what its code (and its fixtures'
code) visibly uses: ``subprocess`` or ``LocalCluster`` needs ``processes``, ``make_server`` or
``Server`` needs ``server``. That cross-check reads names in the code, not strings or
comments, so it is a lower bound: a test that starts processes through a helper of its module
must be put in tests/processes by hand.
"""
import ast
import contextlib
import functools
import gc
import inspect
import os
import pathlib
import sys
import textwrap
import threading

# Before jax starts anywhere in the test process: 8 CPU devices, CPU only (tests/accelerator,
# run alone, drops the cpu again in its conftest: it needs the machine's accelerator).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402

from tests.support import leaks  # noqa: E402


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


# Only names this project can make count: another program's files (podman's libpod_lock)
# are not a leak of ours. tests/support/leaks.py lists the prefixes and why.
shm_entries = leaks.shm_entries


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


# The trees whose modules the suite's processes import: the package, the built-in
# pipelines, the tests' own helpers (run as modules), the examples and the benchmarks.
_COMPILED = ("sidecar", "pipelines", "tests", "examples", "benchmarks")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
  """Compiles the checkout's modules to bytecode once, before any test starts a process.

  Where the environment sets PYTHONDONTWRITEBYTECODE (CI here does), no process writes
  the ``__pycache__`` of the checkout's modules, so each of the suite's process starts (a
  sidecar, a trainer, a feed worker: over a thousand) compiled the package again: 0.6 s of
  the 1.6 s of CPU a sidecar's imports took. Existing bytecode is still read, and checked
  against its source's time as usual (an edited module is compiled anew). The xdist
  workers leave it to the run's first process; ``__pycache__`` is ignored by git and by
  the image's build context."""
  if hasattr(config, "workerinput"):
    return
  import compileall
  root = pathlib.Path(__file__).resolve().parent.parent
  for name in _COMPILED:
    if (root / name).is_dir():
      compileall.compile_dir(str(root / name), quiet=2)
  _one_jax_compilation_cache_for_the_run(config)


def _one_jax_compilation_cache_for_the_run(config) -> None:
  """The run's processes share JAX's persistent compilation cache, as a user's restarted
  job does (``sidecar launch`` names one for its restarts): a program that many launches
  compile (the LM example's step: 11 s of a 20 s launch here) is compiled once per run.

  Named here, before anything imports JAX, so the test processes use it too (the xdist
  workers, started after this, inherit it): one that compiles a program another test or
  the other worker compiled loads it (the LM example's init, 5 s of CPU a compile, is
  compiled again by each ``init_state``). Fresh for each run, removed at its end; the size
  limit only turns on JAX's file lock, so that one process never reads an entry another
  is still writing. A test of the cache itself, or of a compile still running, removes or
  names it."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # the user's: left as it is
    return
  import tempfile
  cache = tempfile.mkdtemp(prefix="sidecar-tests-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
  config.stash[_CACHE_KEY] = cache


_CACHE_KEY = pytest.StashKey[str]()


def pytest_unconfigure(config):
  """Removes the run's JAX compilation cache (``_one_jax_compilation_cache_for_the_run``)."""
  cache = config.stash.get(_CACHE_KEY, None)
  if cache is not None:
    import shutil
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def sidecar_logs_kept_in_the_temp_dir(tmp_path_factory):
  """``sidecar launch`` and ``sidecar local`` keep their sidecars' logs in ./sidecar-logs
  unless told: the suite's go to its temp directory, not into the checkout."""
  os.environ.setdefault("SIDECAR_LOG_DIR", str(tmp_path_factory.mktemp("sidecar-logs")))


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_raises_keyboard_interrupt():
  """SIGINT raises KeyboardInterrupt, as in a terminal, though the run is a background job
  (``pytest &``, nohup), which a shell starts with SIGINT ignored: the interrupt tests send
  this process SIGINT as a kernel interrupt does, and stop their children with it."""
  import signal
  ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  if ignored:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  if ignored:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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


# A server's gRPC thread pools grow when work comes: a module-wide server's get new threads
# during a later test. Server.stop() joins them (test_server.py checks it). The stager
# thread is the process's, kept from save to save (``staging.STAGER``): a test must leave
# it idle. So are shm.copy's threads (``sidecar-copy``), made at the process's first large
# copy and kept for the next, and the save finishers (``finishers.FINISHERS``), named
# ``sidecar-finisher`` while idle (``sidecar-save-STEP`` while a save's finisher runs).
_POOLS = ("sidecar-rpc", "sidecar-health", "sidecar-stager", "sidecar-copy",
          "sidecar-finisher")


def our_threads() -> set[threading.Thread]:
  """The live threads this package started (each is named ``sidecar-...``)."""
  return {t for t in threading.enumerate()
          if t.name.startswith("sidecar") and not t.name.startswith(_POOLS)}


@pytest.fixture(autouse=True)
def no_thread_leak():
  """A test ends with no thread of ours that it started still running: each one's owner
  joins it at ``close()`` (issue 22 item 4). Module-wide fixtures' threads are older."""
  before = our_threads()
  yield
  staging = sys.modules.get("sidecar._src.controller.checkpoint.staging")
  if staging is not None and not eventually(lambda: not staging.STAGER.busy, timeout=5):
    pytest.fail("a test left the stager copying a save's late shards", pytrace=False)
  if our_threads() - before:
    # A closed Worker's releaser ends with the last arena view it lent (by design), and
    # JAX lets go of an aliased view at a collection (jax-ml/jax#14882): collect first.
    gc.collect()
    if "jax" in sys.modules:
      from sidecar._src.jax import transfer
      transfer.release_dropped()
  if not eventually(lambda: not our_threads() - before, timeout=5):
    import traceback
    frames = sys._current_frames()
    left = "\n".join(f"{t.name}:\n" + "".join(traceback.format_stack(frames[t.ident])[-6:])
                     for t in our_threads() - before if t.ident in frames)
    pytest.fail(f"a test left threads of ours running:\n{left}", pytrace=False)


def _held_by_others(names: set[str]) -> set[str]:
  """Those of ``names`` that a process outside this one's tree maps or holds open: a test
  of another pytest-xdist worker made them (or another run's), not this process's test."""
  paths = {os.path.join(leaks.SHM_DIR, n): n for n in names}
  held = set()
  for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid() or _descends_from_us(int(pid)):
      continue
    try:
      with open(f"/proc/{pid}/maps") as f:
        held.update(n for p, n in paths.items() if p in f.read())
      for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
          if (n := paths.get(os.readlink(f"/proc/{pid}/fd/{fd}"))) is not None:
            held.add(n)
    except OSError:
      continue
  return held


@pytest.fixture(autouse=True)
def no_shm_leak():
  """A test leaves no segment of ours in /dev/shm. One that a process of another tree
  holds is not this test's: under ``pytest -n``, the other worker's test runs meanwhile."""
  before = shm_entries()
  yield

  def ours() -> set[str]:
    left = shm_entries() - before
    return left - _held_by_others(left) if left else left

  # Another worker's semaphore (sem.mp-) may be in /dev/shm for a moment held by no process
  # (closed, not yet unlinked): ours stays, its goes within the wait.
  left = ours()
  if left and eventually(lambda: not ours(), timeout=3):
    left = set()
  assert not left, f"a test left segments in /dev/shm: {sorted(ours() or left)}"


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
  """Starts in-process sidecar servers on loopback (or ``listen="unix:PATH"``) with the test
  functions registered."""
  import tempfile

  import sidecar
  from sidecar._src.core import options as options_lib
  from sidecar._src.server import client_log
  from sidecar._src.server.server import Server
  from sidecar._src.user import registry as registry_lib
  from tests.support import sidecar_fns  # noqa: F401  (registers into the default registry)
  servers = []
  replica_hosts = tmp_path / "replica-hosts"
  # Each test's sidecars their own log buckets: a tenant named alice in an earlier test
  # never spent this one's lines (server/client_log.py).
  default_log, client_log.DEFAULT = client_log.DEFAULT, client_log.ClientLog()

  def make(**kw):
    reg = kw.pop("registry", None)
    if reg is None:
      reg = registry_lib.Registry()
      for entry in sidecar.default_registry():
        if entry.fn.__module__ == "tests.support.sidecar_fns":
          reg.add(entry.kind, entry.name, entry.fn)
    kw.setdefault("shm_size", 8 << 20)
    kw.setdefault("checkpoint_roots", (str(tmp_path), tempfile.gettempdir()))
    kw.setdefault("replica_token", PEER_TOKEN)  # the servers of one test are one job's peers
    kw.setdefault("listen", "127.0.0.1")  # or unix:PATH
    if "replica_hosts" not in kw:  # the test's servers by host id, as LocalCluster's
      kw.setdefault("replica_hosts_file", str(replica_hosts))
    opts = options_lib.ServerOptions(port=0, health_port=0,
                                 socket_path=str(tmp_path / f"s{len(servers)}.sock"), **kw)
    server = Server(opts, registry=reg).start()
    servers.append(server)
    by_host = {s.options.host_id: s for s in servers}
    replica_hosts.write_text("\n".join(
        by_host[h].address for h in range(len(by_host)) if h in by_host))
    return server

  yield make
  for s in servers:
    s.stop(grace=0)
  client_log.DEFAULT = default_log


# Each tier may do what the ones before it do. tests/accelerator (the machine's TPU or GPU) runs
# alone and never in CI: tests/accelerator/conftest.py.
TIERS = ("unit", "server", "processes", "accelerator")
TESTS = pathlib.Path(__file__).parent
_MARK_IT = {"unit": "(no sockets, no processes)", "server": "(an in-process gRPC sidecar)",
            "processes": "(LocalCluster, subprocesses)",
            "accelerator": "(the machine's TPU or GPU, run alone)"}
# Names whose use in a test or its fixtures shows the tier it needs at least.
_STARTS_PROCESSES = frozenset({"LocalCluster", "subprocess", "Popen", "multiprocessing",
                               "KernelManager", "nbclient", "launch.run"})
_STARTS_A_SERVER = frozenset({"make_server", "Server", "grpc.server"})


def _tiers_of(node) -> list[str]:
  return sorted({m.name for m in node.own_markers if m.name in TIERS}, key=TIERS.index)


def _folder_tier(item) -> str | None:
  """The tier of the folder the test's module is in: tests/<tier>/..., else None."""
  parts = item.path.relative_to(TESTS).parts
  return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def _same_subject(item, tier: str) -> str:
  """Where a test of ``tier`` on the subject of ``item``'s module goes."""
  parts = item.path.relative_to(TESTS).parts
  return "/".join(("tests", tier, *parts[1:]))


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


def _tier_problems(item) -> list[str]:
  """What is wrong with ``item``'s tier (nothing, mostly): each problem names the fix."""
  module = item.nodeid.split("::")[0]
  folder = _folder_tier(item)
  if folder is None:
    return [f"{module} is in no tier's folder: move it to tests/unit, tests/server or "
            f"tests/processes (the tier its tests need), mirroring sidecar/_src"]
  declare = f"`pytestmark = pytest.mark.{folder}` {_MARK_IT[folder]}"
  problems = []
  for node in item.listchain()[item.listchain().index(item.getparent(pytest.Module)) + 1:]:
    for tier in _tiers_of(node):
      problems.append(f"{node.nodeid} carries its own @pytest.mark.{tier}: a test's tier is its "
                      f"folder's, declared once by its module; drop the marker" + (
                          "" if tier == folder else
                          f" and move the test to {_same_subject(item, tier)}"))
  match _tiers_of(item.getparent(pytest.Module)):
    case []:
      return [*problems, f"{module} declares no tier: put {declare} in one line after its imports"]
    case [tier] if tier != folder:
      return [*problems, f"{module} declares {tier} but is in tests/{folder}: move it to "
                         f"{_same_subject(item, tier)}, or declare {declare}"]
    case [_]:
      pass
    case several:
      return [*problems, f"{module} declares the tiers {' and '.join(several)}: keep {declare}"]
  needs, why = _visible_tier(item)
  if TIERS.index(needs) > TIERS.index(folder):
    problems.append(f"{item.nodeid} is in tests/{folder} but uses {', '.join(sorted(why))}: "
                    f"move it to {_same_subject(item, needs)}")
  return problems


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by these markers
def pytest_collection_finish(session):
  """Every test module, and all it imports (jax, torch, Orbax, TensorStore), is loaded:
  frozen, that heap is out of the way of each later collection. tests/server spent 15.7 s
  of its 85 in 2,377 collections without; 3.8 s of 74 with."""
  gc.collect()
  gc.freeze()


def pytest_collection_modifyitems(config, items):
  problems = [p for item in items if isinstance(item, pytest.Function)
              for p in _tier_problems(item)]
  if problems:
    raise pytest.UsageError("test tiers:\n  " + "\n  ".join(dict.fromkeys(problems)))


@pytest.fixture(scope="session", autouse=True)
def no_process_left_mapping_an_arena():
  """After the whole run: no process this run started still maps a sidecar arena.

  A memfd arena never appears in /dev/shm, so ``no_shm_leak`` cannot see it.
  """
  yield
  assert eventually(lambda: not arena_mappers(), timeout=10), (
      f"processes this test run started still map an arena: {arena_mappers()}")
