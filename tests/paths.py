"""Where the suite and the checkout are on disk (tests in sub-folders cannot count dirname() levels)."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))  # tests/
ROOT = os.path.dirname(TESTS)  # the checkout: README.md, bench/, examples/
