"""``sidecar ram-tier drop``: an operator drops RAM-tier copies of durable steps now.

A sidecar keeps the newest committed steps of each checkpoint directory in its arena for
fast restores, and they give way by themselves to new work that needs the room; this frees
a directory's (``--directory``) or a tenant's (``--tenant``, a pool's) copies at once, on
each sidecar named (or the job's, as ``Controller.from_env()`` finds them). It shakes hands
with the token in ``$SIDECAR_TOKEN`` (or ``$SIDECAR_TOKEN_FILE``): a tenant's token drops
that tenant's copies only, the pool's operator token (operator_token_file) anyone's.
Steps not durable yet stay and are listed. Exit status 0 once every sidecar answered.
"""

from __future__ import annotations

import argparse

from sidecar._src.tools import cli_format, cli_types


def _run(args: argparse.Namespace) -> int:
  from sidecar._src.controller.checkpoint import ram_drop
  req = ram_drop.request(args.directory, args.tenant)
  result = ram_drop.drop_at(cli_types.addresses(args), req, token=cli_types.token(args),
                            timeout=args.timeout)
  print(result.describe())
  return 0


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``ram-tier drop`` to ``subparsers`` (``sidecar``'s commands)."""
  tier = subparsers.add_parser(
      "ram-tier", help="the RAM tier: checkpoint steps kept in the sidecars' arenas",
      description="Act on the RAM tier of sidecars: the committed checkpoint steps they keep "
                  "in their arenas for fast restores (docs/operations.md).",
      formatter_class=cli_format.DefaultsFormatter)
  commands = tier.add_subparsers(dest="ram-tier_command", metavar="{drop}")
  commands.required = True
  s = commands.add_parser(
      "drop", help="drop a directory's or a tenant's RAM-tier copies of durable steps now",
      formatter_class=cli_format.DefaultsFormatter, description=__doc__.split("\n\n")[1])
  which = s.add_mutually_exclusive_group(required=True)
  which.add_argument("--directory", metavar="DIR",
                     help="the checkpoint directory (as the sidecars see it) whose copies go, "
                          "with those of the directories in it (default: none: give this or "
                          "--tenant)")
  which.add_argument("--tenant", metavar="NAME",
                     help="the pool tenant whose copies go, every directory it opened "
                          "(default: none: give this or --directory)")
  cli_types.add_sidecar_flags(s, timeout=10.0)
  s.set_defaults(func=_run, parser=s)
