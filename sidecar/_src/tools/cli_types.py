"""The ``sidecar`` command's argument types: each reads one flag's text or says, as argparse
does for a bad ``type=int``, what it wanted (``sidecar serve: error: argument ...``)."""

from __future__ import annotations

import argparse

from sidecar._src.arena import shm
from sidecar._src.core import address as address_lib, env as env_lib, errors


def ids(text: str) -> tuple[int, ...]:
  """``--device-ids``: comma-separated ints."""
  try:
    return tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"expected comma-separated ints like 0,1, got {text!r}") from None


def size(text: str) -> int:
  """A size such as ``4GiB``, in bytes."""
  try:
    return shm.parse_size(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def quota(text: str) -> float | int:
  """``--session-quota``: a fraction of the arena (``0.5``) or a size (``2GiB``)."""
  try:
    share = float(text)
  except ValueError:
    return size(text)
  if not 0 < share <= 1:
    raise argparse.ArgumentTypeError(
        f"a share of the arena must be in (0, 1] (or a size such as 2GiB), got {text!r}")
  return share


def address(text: str) -> str:
  """A sidecar's ``unix:PATH`` or ``HOST:PORT``, unchanged once read: a port outside
  1..65535 is refused here, where gRPC would dial it modulo 65536 and name that port."""
  try:
    address_lib.parse(text, what="ADDR")
  except errors.InvalidArgumentError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


def add_sidecar_flags(p: argparse.ArgumentParser, *, timeout: float) -> None:
  """The flags of a command that asks sidecars something: the addresses, ``--timeout``
  and ``--token-file`` (read back with :func:`addresses` and :func:`token`)."""
  p.add_argument("addresses", nargs="*", metavar="ADDR", type=address,
                 help="the sidecars' gRPC addresses, unix:PATH or HOST:PORT (default: those "
                      "SIDECAR_HOSTS lists, or the JobSet's as Controller.from_env() finds them)")
  p.add_argument("--timeout", type=float, default=timeout, metavar="S",
                 help="seconds each sidecar is given to answer")
  p.add_argument("--token-file", metavar="FILE",
                 help="file holding the token to present (default: $SIDECAR_TOKEN, else the "
                      "file $SIDECAR_TOKEN_FILE names, as Controller.from_env() reads them; "
                      "else none)")


def add_status_flags(p: argparse.ArgumentParser, *, json_help: str, watch_help: str) -> None:
  """The flags of a command that asks sidecars for their state (``sidecar status``,
  ``sidecar pool status``): :func:`add_sidecar_flags`' and ``--json``, ``--watch`` and
  ``--interval``."""
  add_sidecar_flags(p, timeout=5.0)
  p.add_argument("--json", action="store_true", help=json_help)
  p.add_argument("--watch", action="store_true", help=watch_help)
  p.add_argument("--interval", type=float, default=2.0, metavar="S",
                 help="seconds between refreshes of --watch")


def addresses(args: argparse.Namespace) -> list[str]:
  """The sidecars a command asks: its ADDR arguments, else the job's, as
  ``Controller.from_env()`` finds them; none found is a usage error saying why."""
  if args.addresses:
    return list(args.addresses)
  from sidecar._src.controller import discovery  # the controller's, only where needed
  parser: argparse.ArgumentParser = args.parser
  try:
    return [e.address for e in discovery.endpoints_from_env()]
  except errors.SidecarError as e:
    parser.error(f"no ADDR given, and {e}")


def token(args: argparse.Namespace) -> str | None:
  """The token a command that asks sidecars presents: ``--token-file``, else
  ``$SIDECAR_TOKEN``, else ``$SIDECAR_TOKEN_FILE``'s (env.token, as ``Controller.from_env()``);
  a file that cannot be read is a usage error naming it."""
  parser: argparse.ArgumentParser = args.parser
  try:
    return env_lib.token(args.token_file)
  except (OSError, errors.InvalidArgumentError) as e:
    parser.error(f"cannot read the token: {e}")
