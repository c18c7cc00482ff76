"""One sidecar address, however it is given: ``sidecar serve --listen``, a Controller,
``sidecar status``, ``SIDECAR_HOSTS``, a ready file, a peer for replicas.

Two forms, both gRPC targets as they are written:

- ``unix:PATH`` (or gRPC's ``unix:///ABSOLUTE/PATH``): a sidecar on a Unix socket of this
  machine. No port, nothing on the network; the socket file's mode is its access control,
  so it needs no token. Health (``grpc.health.v1``) answers on the same socket.
- ``HOST:PORT`` (IPv6 in brackets: ``[::1]:8490``): TCP, for other machines.

Example::

  address.parse("unix:/run/sidecar/grpc.sock")  # Address(path='/run/sidecar/grpc.sock')
  address.parse("10.0.0.7:8490")                 # Address(host='10.0.0.7', port=8490)
  address.parse("node-3", default_port=8490)     # Address(host='node-3', port=8490)
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import stat

from sidecar._src.core import errors

UNIX = "unix:"
# The longest path a Unix socket may bind to: sun_path is 108 bytes, with its final NUL.
SOCKET_PATH_MAX = 107


@dataclasses.dataclass(frozen=True, slots=True)
class Address:
  """Where a sidecar's gRPC server is: a Unix socket ``path``, or TCP ``host`` and ``port``."""
  host: str = ""  # TCP: a host name or IP address, IPv6 without brackets
  port: int = 0
  path: str = ""  # a Unix socket

  @property
  def is_unix(self) -> bool:
    return bool(self.path)

  @property
  def target(self) -> str:
    """The gRPC target: ``unix:PATH`` or ``HOST:PORT``."""
    if self.path:
      return f"{UNIX}{self.path}"
    host = f"[{self.host}]" if ":" in self.host else self.host
    return f"{host}:{self.port}"

  def __str__(self) -> str:
    return self.target


def is_unix(text: str) -> bool:
  """Whether ``text`` is written as a Unix socket address (``unix:...``)."""
  return text.strip().startswith(UNIX)


def unix(path: str) -> Address:
  """The address of a Unix socket at ``path``, made absolute, its length checked.

  Raises:
    InvalidArgumentError: the path is empty or longer than a Unix socket's may be.
  """
  if not path:
    raise errors.InvalidArgumentError(
        "a unix: address needs a path, e.g. unix:/run/sidecar/grpc.sock")
  path = os.path.abspath(path)
  check_socket_path(path, fix="use a shorter path (a directory near /, such as "
                    "/run/sidecar or /tmp)")
  return Address(path=path)


def check_socket_path(path: str, *, fix: str) -> None:
  """Raises InvalidArgumentError naming ``path``, its length, the limit and ``fix`` where a
  Unix socket cannot bind to it (the kernel's own error names none of them)."""
  if (n := len(os.fsencode(path))) > SOCKET_PATH_MAX:
    raise errors.InvalidArgumentError(
        f"cannot use the Unix socket {path}: its path is {n} bytes, a Unix socket's may be "
        f"at most {SOCKET_PATH_MAX}; {fix}")


def parse(text: str, *, default_port: int | None = None, what: str = "address") -> Address:
  """Reads ``unix:PATH``, ``unix:///PATH``, ``HOST:PORT``, ``[IPV6]:PORT``, or a bare host
  where ``default_port`` is given.

  Raises:
    InvalidArgumentError: naming ``what``, the text and the forms it may take.
  """
  text = text.strip()
  if text.startswith(UNIX):
    path = text[len(UNIX):]
    if path.startswith("//"):  # gRPC's unix://ABSOLUTE_PATH
      path = path[2:]
      if not path.startswith("/"):
        raise errors.InvalidArgumentError(
            f"{what} {text!r}: unix:// takes an absolute path (unix:///run/x.sock); write "
            "unix:PATH for a relative one")
    return unix(path)
  plain = "unix:PATH or HOST:PORT"
  forms = f"{plain} (IPv6 in brackets: [::1]:8490)"
  if looks_like_path(text):  # no word on IPv6 where the text is none
    raise errors.InvalidArgumentError(
        f"{what} {text!r} is a path, not {plain}: a sidecar on a Unix socket is unix:{text}")
  if text.startswith("["):
    host, sep, rest = text[1:].partition("]")
    if not sep or (rest and not rest.startswith(":")):
      raise errors.InvalidArgumentError(f"{what} {text!r} is malformed; write {forms}")
    port_text = rest[1:] if rest else None
  else:
    host, sep, port_text_ = text.partition(":")
    port_text = port_text_ if sep else None
    if ":" in port_text_:
      if _is_ipv6(text) or _is_ipv6(text.rpartition(":")[0]):
        raise errors.InvalidArgumentError(
            f"{what} {text!r} is not {forms}: put an IPv6 address in brackets")
      raise errors.InvalidArgumentError(f"{what} {text!r} is not {plain}: {_colons(text)}")
  if not host:
    raise errors.InvalidArgumentError(f"{what} {text!r} names no host; write {forms}")
  if port_text is None:
    if default_port is None:
      raise errors.InvalidArgumentError(f"{what} {text!r} has no port; write {forms}")
    return Address(host=host, port=default_port)
  if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
    raise errors.InvalidArgumentError(
        f"{what} {text!r} has port {port_text!r}; ports are integers in 1..65535")
  return Address(host=host, port=int(port_text))


def looks_like_path(text: str) -> bool:
  """Whether ``text``, written without ``unix:``, names a socket file: it holds a '/' (no
  host name or port does), or a socket of that name is here."""
  try:
    return "/" in text or stat.S_ISSOCK(os.stat(text).st_mode)
  except (OSError, ValueError):
    return False


def _colons(text: str) -> str:
  """What is wrong with ``text``, which holds more than one ':', no brackets, and is no
  IPv6 address."""
  host, _, ports = text.partition(":")
  if all(p.isdigit() for p in ports.split(":")):
    return (f"it has {ports.count(':') + 1} ports; give the control port alone, as "
            f"{host}:PORT (sidecar serve --port; the health port is for the kubelet's probes)")
  return "it holds more than one ':'"


def _is_ipv6(text: str) -> bool:
  try:
    ipaddress.IPv6Address(text)
  except ValueError:
    return False
  return True


def access_problem(path: str) -> str | None:
  """Why this process may not connect to the Unix socket at ``path`` (which needs write
  permission on it, and search permission on its directories), or None: it may, or there
  is no file yet (then the connection says so itself)."""
  if os.access(path, os.W_OK):
    return None
  try:
    info = os.stat(path)
  except FileNotFoundError:
    return None
  except PermissionError:
    directory = os.path.dirname(path)
    return (f"this process (uid {os.getuid()}, gid {os.getgid()}) may not enter "
            f"{directory}, which holds the socket")
  kind = "socket" if stat.S_ISSOCK(info.st_mode) else "file, not a socket,"
  return (f"permission denied: {path} is a {kind} of mode {info.st_mode & 0o7777:04o}, "
          f"owner uid {info.st_uid}, gid {info.st_gid}, and this process is uid "
          f"{os.getuid()}, gid {os.getgid()}; run it as the sidecar's user, or serve with "
          "--socket-group GROUP (mode 0660) and a group this process is in")


def check_access(text: str) -> None:
  """For a client about to dial ``text``: a ``unix:`` socket this process may not open is
  an error now, naming the path and its mode, not a connection that fails or times out.

  Raises:
    PermissionDeniedError: this process lacks the permission to connect.
  """
  if not is_unix(text):
    return
  path = parse(text).path
  if problem := access_problem(path):
    raise errors.PermissionDeniedError(f"cannot connect to the sidecar at {text}: {problem}")
