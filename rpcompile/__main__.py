"""`python -m rpcompile ...`: the command line (`rpcompile.cli.main`)."""
import sys

from rpcompile.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
