import os
from multiprocessing.shared_memory import SharedMemory  # makes a segment, starts nothing

import pytest

from tests.conftest import shm_entries  # what no_shm_leak and the tests compare
from tests.support import leaks

pytestmark = pytest.mark.unit


@pytest.fixture
def shm_file():
  made = []

  def make(name: str) -> str:
    path = os.path.join(leaks.SHM_DIR, name)
    # Held open until the test ends, as a library's segment is while in use: a test of
    # another pytest-xdist worker that ends meanwhile sees it held, so not its leak.
    made.append(open(path, "x"))
    return name

  yield make
  for f in made:
    f.close()
    os.unlink(f.name)


def test_another_programs_files_are_not_ours(shm_file):
  # podman leaves libpod_lock; lttng, another job's semaphores: none is a leak of the suite.
  for name in (f"libpod_lock-{os.getpid()}", f"lttng-ust-wait-{os.getpid()}",
               f"sem.other-{os.getpid()}"):
    assert shm_file(name) not in shm_entries()


@pytest.mark.parametrize("name", ["psm_", "sem.mp-", "pym-", "torch_", "sidecar-"], ids=str)
def test_what_our_libraries_name_is_ours(shm_file, name):
  assert shm_file(f"{name}leak-test-{os.getpid()}") in shm_entries()


def test_a_python_shared_memory_segment_is_ours_until_unlinked():
  segment = SharedMemory(create=True, size=4096)
  try:
    assert segment.name.lstrip("/") in shm_entries()
  finally:
    segment.close()
    segment.unlink()
  assert segment.name.lstrip("/") not in shm_entries()
