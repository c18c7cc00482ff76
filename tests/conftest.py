"""Shared fixtures. Every test that makes shared memory proves it is gone afterwards.

Every test gets one tier marker, from what its code (and its fixtures' code) starts:
``processes`` (sidecar, trainer or kernel processes: LocalCluster, ``sidecar launch``,
subprocesses), ``server`` (an in-process gRPC sidecar), else ``unit``. So
``pytest -m unit`` runs in seconds, and ``pytest -m "not processes"`` in about a minute.
"""

import inspect
import os
import re

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


@pytest.fixture
def make_server(tmp_path):
  """Starts in-process sidecar servers on loopback with the test functions registered."""
  import tempfile

  import sidecar
  from sidecar._src import options, registry as registry_lib
  from sidecar._src.host.server import Server
  from tests import sidecar_fns  # noqa: F401  (registers into the default registry)

  servers = []

  def make(**kw):
    reg = kw.pop("registry", None)
    if reg is None:
      reg = registry_lib.Registry()
      for entry in sidecar.default_registry():
        if entry.fn.__module__ == "tests.sidecar_fns":
          reg.add(entry.kind, entry.name, entry.fn)
    kw.setdefault("shm_size", 8 << 20)
    kw.setdefault("checkpoint_roots", (str(tmp_path), tempfile.gettempdir()))
    opts = options.ServerOptions(listen="127.0.0.1", port=0, health_port=0,
                                 socket_path=str(tmp_path / f"s{len(servers)}.sock"), **kw)
    server = Server(opts, registry=reg).start()
    servers.append(server)
    return server

  yield make
  for s in servers:
    s.stop(grace=0)


_PROCESSES = re.compile(r"LocalCluster|subprocess|Popen|launch\.run|multiprocessing|"
                        r"start_local|_start\(|KernelManager|nbclient")
_SERVER = re.compile(r"make_server|Server\(|grpc\.server\(")


def _sources(item) -> str:
  """The test function's code and that of every fixture it uses (transitively)."""
  parts = []
  for fn in [getattr(item, "function", None), *(
      d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs)]:
    try:
      parts.append(inspect.getsource(fn))
    except (OSError, TypeError):
      continue
  return "\n".join(parts)


def _module_source(item) -> str:
  try:
    return inspect.getsource(item.module)
  except (OSError, TypeError, AttributeError):
    return ""


def pytest_collection_modifyitems(config, items):
  for item in items:
    source = _sources(item)
    tier = ("processes" if _PROCESSES.search(source) or "multiprocess" in item.path.parts
            else "server" if _SERVER.search(source) or _SERVER.search(_module_source(item))
            else "unit")
    item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session", autouse=True)
def no_process_left_mapping_an_arena():
  """After the whole run: no process this run started still maps a sidecar arena.

  A memfd arena never appears in /dev/shm, so ``no_shm_leak`` cannot see it.
  """
  yield
  assert eventually(lambda: not arena_mappers(), timeout=10), (
      f"processes this test run started still map an arena: {arena_mappers()}")
