"""``--help`` that states every flag's default: the ``sidecar`` commands' formatters.

``argparse.ArgumentDefaultsHelpFormatter`` appends ``(default: None)`` and
``(default: False)`` too, and a second default where the help already explains one
(``$SIDECAR_PORT, else 8490``). These append ``(default: X)`` only where the help names
no default and there is one to show.
"""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.HelpFormatter):
  """Appends ``(default: X)`` to a flag's help that does not say its default itself."""

  def _get_help_string(self, action: argparse.Action) -> str | None:
    text = action.help or ""
    default = action.default
    if ("default" in text or default is None or isinstance(default, bool)
        or default is argparse.SUPPRESS or not action.option_strings):
      return text
    return f"{text} (default: %(default)s)"


class RawDescriptionDefaultsFormatter(DefaultsFormatter, argparse.RawDescriptionHelpFormatter):
  """:class:`DefaultsFormatter`, keeping the description's and epilog's line breaks."""
