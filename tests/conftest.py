"""The suite's shared setup: tests/ on sys.path, so every test folder imports the helpers beside this file.

Tests sit in folders like the code (tests/ir, tests/passes/..., tests/runtime/..., tests/driver,
tests/finetune, tests/cli); the helpers they share stay here: `models` (small torch models and
batches), `oracle` (the staleness reference loop), `hf_fixtures` (tiny local Hugging Face models and
tokenizers), `strategies` (hypothesis), `packing_reference`, `dist_launch` and `paths` (ROOT, TESTS).
"""
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
