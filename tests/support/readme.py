"""The README's quick start, as the files it names: run by tests/processes/test_readme.py on
CPU devices and by tests/accelerator/test_readme.py on the chip."""

import re

from tests.support.paths import ROOT


def quick_start() -> dict[str, str]:
  """{relative path: source} of the python blocks under "In five minutes", each named by
  its first line's comment (``# my_pkg/sidecar_fns.py: ...``)."""
  text = (ROOT / "README.md").read_text()
  section = text.split("## In five minutes", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  return {re.match(r"# (\S+\.py):", b).group(1): b for b in blocks}
