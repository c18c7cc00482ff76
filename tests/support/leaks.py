"""The /dev/shm names this project can leave behind, and nothing else's.

The arena is a memfd: it never appears in /dev/shm. Named segments come only from the
libraries the sidecar, its feed workers and the tests use, each with a fixed prefix:

- ``psm_``: Python's ``multiprocessing.shared_memory`` (Grain's ``SharedMemoryArray``,
  ``mp_prefetch``, its in-memory data source's ``ShareableList``);
- ``sem.mp-``: semaphores of ``multiprocessing`` locks and queues in spawned processes;
- ``pym-``: ``multiprocessing.heap`` arenas (``Value``, ``Array``), unlinked at once unless
  the process dies in between;
- ``torch_``: PyTorch's shared tensors (``torch.multiprocessing``, DataLoader workers);
- ``sidecar``: this project's own files (a test's ``sidecar-direct-io-test-PID``).

Anything else in /dev/shm belongs to another program on the machine (podman's
``libpod_lock``, lttng, another job's semaphores) and is none of the suite's business.

``python -m tests.support.leaks`` prints ours, one a line; ``.ci/run`` compares that
before and after the suite. Standard library only: it runs before the venv exists.
"""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm"
OUR_PREFIXES = ("psm_", "sem.mp-", "pym-", "torch_", "sidecar")


def shm_entries() -> set[str]:
  """The entries of /dev/shm that this project's code or its libraries made."""
  try:
    names = os.listdir(SHM_DIR)
  except FileNotFoundError:
    return set()
  return {n for n in names if n.startswith(OUR_PREFIXES)}


if __name__ == "__main__":
  for name in sorted(shm_entries()):
    print(name)
