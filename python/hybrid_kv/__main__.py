"""`python -m hybrid_kv`: the `hybrid-kv` command line."""

import sys

from hybrid_kv.cli import main

if __name__ == "__main__":
    sys.exit(main())
