"""What /proc says about a process's sockets (Linux), for tests that check what it opened."""

import os


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
