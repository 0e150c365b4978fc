"""`python -m rpcompile ...`: the command line (`rpcompile.cli.main`)."""
import gc
import sys

from rpcompile.cli.main import main

if __name__ == "__main__":
    rc = main()
    gc.freeze()  # the interpreter's exit skips a last sweep of every object torch and transformers made: ~1 s
    sys.exit(rc)
