"""What /proc says about a process's sockets (Linux), for tests that check what it opened."""

import os

ARENA_FILE = "/memfd:sidecar-arena (deleted)"  # a sidecar's arena, as /proc/PID/maps names it


def socket_inodes(pid: int) -> set[str]:
  """The inodes of every socket process ``pid`` holds open (``socket:[N]`` descriptors)."""
  inodes = set()
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:  # closed meanwhile
      continue
    if link.startswith("socket:["):
      inodes.add(link[8:-1])
  return inodes


def mapping_of(address: int) -> tuple[str, str]:
  """The permissions (``rw-p``: private, ``rw-s``: shared) and the path of this process's
  mapping that holds ``address`` (``/memfd:NAME (deleted)`` for a memfd's)."""
  with open("/proc/self/maps") as f:
    for line in f:
      fields = line.split(maxsplit=5)
      start, end = (int(x, 16) for x in fields[0].split("-"))
      if start <= address < end:
        return fields[1], fields[5].strip() if len(fields) > 5 else ""
  raise LookupError(f"no mapping holds {address:#x}")
