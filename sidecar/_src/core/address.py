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

import concurrent.futures
import dataclasses
import ipaddress
import os
import socket
import stat
from collections.abc import Sequence

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


def parse_entry(text: str, *, port: int, health_port: int,
                what: str = "SIDECAR_HOSTS entry") -> tuple[Address, int]:
  """A host list's entry (``SIDECAR_HOSTS``, a cluster file's hosts) and its health port:
  ``unix:PATH`` (health answers on the same socket: port 0), or ``HOST[:PORT[:HEALTH_PORT]]``
  (IPv6 in brackets: ``[::1]:8490:8491``), each port not given ``port`` or ``health_port``.

  Raises:
    InvalidArgumentError: naming ``what``, the text and the forms it may take; a path
      written without ``unix:`` is told its ``unix:`` spelling.
  """
  text = text.strip()
  if is_unix(text):
    return parse(text, what=what), 0
  forms = "HOST[:PORT[:HEALTH_PORT]] or unix:PATH"
  if looks_like_path(text):
    raise errors.InvalidArgumentError(
        f"{what} {text!r} is a path, not {forms}: a sidecar on a Unix socket is unix:{text}")
  if text.startswith("["):
    host, sep, rest = text[1:].partition("]")
    if not sep or (rest and not rest.startswith(":")):
      raise errors.InvalidArgumentError(
          f"{what} {text!r} is malformed; write IPv6 hosts as [ADDR]:PORT")
    parts = [host] + (rest[1:].split(":") if rest else [])
  else:
    parts = text.split(":")
  if len(parts) > 3 or not parts[0]:
    raise errors.InvalidArgumentError(
        f"{what} {text!r} is not {forms}; put IPv6 addresses in brackets, e.g. "
        "[::1]:8490:8491")
  ports = []
  for given in parts[1:]:
    if not given.isdigit() or not 1 <= int(given) <= 65535:
      raise errors.InvalidArgumentError(
          f"{what} {text!r} has port {given!r}; ports are integers in 1..65535")
    ports.append(int(given))
  ports += [port, health_port][len(ports):]
  return Address(host=parts[0], port=ports[0]), ports[1]


# What getaddrinfo answers for a name that does not exist (NXDOMAIN, or no such entry in
# /etc/hosts), not for a DNS that is slow or down (EAI_AGAIN): that one may yet answer.
_NO_SUCH_NAME = frozenset({socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)})


def unresolvable(host: str) -> str | None:
  """Why host name ``host`` can never be dialed (the resolver says no such name), or None:
  it resolves, it is an IP address, or the resolver cannot tell now."""
  if not host or _is_ip(host):
    return None
  try:
    socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
  except socket.gaierror as e:
    return e.strerror if e.errno in _NO_SUCH_NAME else None
  except UnicodeError as e:  # a label over 63 characters, or an empty one
    return f"not a host name: {e}"
  return None


def check_resolvable(addresses: Sequence[Address], *, what: str) -> None:
  """Refuses at once the TCP ``addresses`` whose host name does not exist, as no wait can
  make them answer (a name that resolves waits for its sidecar as long as asked). The
  names are looked up together, each once.

  Raises:
    InvalidArgumentError: naming each such address, why, and the forms to use.
  """
  hosts = sorted({a.host for a in addresses if a.host and not _is_ip(a.host)})
  if len(hosts) > 1:
    with concurrent.futures.ThreadPoolExecutor(
        min(len(hosts), 32), thread_name_prefix="sidecar-resolve") as pool:
      why = dict(zip(hosts, pool.map(unresolvable, hosts)))
  else:
    why = {h: unresolvable(h) for h in hosts}
  bad = [f"{a.target} ({why[a.host]})" for a in addresses if why.get(a.host)]
  if bad:
    raise errors.InvalidArgumentError(
        f"{what}: {', '.join(bad)}: no such host name, so no sidecar can ever answer there; "
        "give HOST:PORT with a host name this machine resolves (or an IP address), or "
        "unix:PATH for a sidecar on this machine")


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


def _is_ip(text: str) -> bool:
  try:
    ipaddress.ip_address(text)
  except ValueError:
    return False
  return True


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
