"""Helpers shared by bench scripts: machine description and writing docs/bench/*.md."""
from __future__ import annotations

import datetime
import os
import platform
import sys

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "bench")


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """One markdown line: exact command, date, CPU, cores, torch version and threads."""
    import torch
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    return (f"command: `{cmd}`  \ndate: {datetime.datetime.now():%Y-%m-%d %H:%M}  \n"
            f"CPU: {cpu_model()}, {os.cpu_count()} cores  \n"
            f"torch {torch.__version__}, torch threads {torch.get_num_threads()}")


def write_doc(name: str, text: str) -> str:
    """Write docs/bench/<name> and return its path."""
    os.makedirs(DOCS, exist_ok=True)
    path = os.path.normpath(os.path.join(DOCS, name))
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    return path


def tree_at(rev: str) -> str:
    """A temporary copy of the package at git revision `rev`, laid out as installed (put it on PYTHONPATH).

    `git archive rev rpcompile passes runtime`, with passes/ and runtime/ moved into rpcompile/ (what
    pyproject's package-dir does for the installed package), so a child process with PYTHONPATH=<the copy>
    imports only the old modules. The caller removes the folder (shutil.rmtree) when done.
    """
    import subprocess
    import tempfile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tempfile.mkdtemp(prefix="rpcompile-before-")
    tar = subprocess.run(["git", "archive", rev, "rpcompile", "passes", "runtime"], cwd=root,
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=tar, check=True)
    for part in ("passes", "runtime"):
        os.rename(os.path.join(out, part), os.path.join(out, "rpcompile", part))
    return out
