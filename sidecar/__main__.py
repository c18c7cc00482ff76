import sys

from sidecar._src.tools.cli import main

sys.exit(main())
