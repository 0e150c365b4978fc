"""`python -m rpcompile ...`: the command line (`rpcompile.cli.main`)."""
import gc
import os
import sys

# plan and simulate are short: no cyclic garbage collection for them. Its sweeps over the objects the imports of
# torch, transformers and sympy leave (millions, all alive) took about a third of `plan` (gpt-oss-20b: 8.1 ->
# 5.7 s; qwen3-235b-a22b: 10.2 -> 7.0 s), and the garbage left to the process's end is about 2% of its memory
# (454 -> 465 MB). Training and fine-tuning run for hours with collection as usual.
if __name__ == "__main__" and sys.argv[1:2] in (["plan"], ["simulate"]):
    gc.disable()

from rpcompile.cli.main import main  # noqa: E402

if __name__ == "__main__":
    rc = main()
    gc.freeze()  # the interpreter's exit skips a last sweep of every object torch and transformers made: ~1 s
    if not gc.isenabled():  # plan, simulate: all done once the output is out, so the process ends here, without
        try:                # the interpreter's teardown (freeing the imports' objects one by one: ~0.3 s of plan)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc or 0)
    sys.exit(rc)
