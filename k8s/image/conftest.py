"""The image test's figures: each test records what it measured; the summary prints them."""

import os

import pytest

FIGURES = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def figures(request) -> dict[str, str]:
  return request.config.stash.setdefault(FIGURES, {})


def pytest_terminal_summary(terminalreporter, config):
  measured = config.stash.get(FIGURES, {})
  if measured:
    terminalreporter.write_sep("-", f"image test figures (load average "
                                    f"{os.getloadavg()[0]:.1f})")
    for what, value in measured.items():
      terminalreporter.write_line(f"{what:<42} {value}")
