"""A race made to happen: another process removes a path just as this one touches it."""

import pathlib
import shutil


def removed_first(monkeypatch, owner, attr: str, path: pathlib.Path) -> list[pathlib.Path]:
  """Makes the first call of ``owner.attr`` on ``path`` find it gone: the directory is
  removed (as another host's retention, abort or sweep would) just before that call runs.
  Returns the list holding ``path`` until then; empty once the race happened."""
  real, pending = getattr(owner, attr), [path]

  def wrapped(p, *args, **kwargs):
    if pending and pathlib.Path(p) == path:
      shutil.rmtree(pending.pop())
    return real(p, *args, **kwargs)
  monkeypatch.setattr(owner, attr, wrapped)
  return pending
