import sys

from sidecar._src.cli import main

sys.exit(main())
