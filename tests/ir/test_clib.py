"""The kernels' cache (`rpcompile.ir.cache`) and its C libraries (`rpcompile.ir.clib`): an entry is built once,
atomically, sealed with its size and digest, and a damaged one (cut short, garbage, unsealed) is built again
before anything maps it."""
import json
import os
import shutil
import threading

import pytest

import forked
from rpcompile.ir import cache
from rpcompile.ir.clib import CLibrary

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")


@pytest.fixture
def library(monkeypatch, tmp_path):
    """A one-function C library whose cache is a fresh folder."""
    monkeypatch.setenv("RPCOMPILE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "seven.c"
    source.write_text("int seven(void) { return 7; }\n")
    return CLibrary("rpcompile_test", sources=(str(source),), switch="RPCOMPILE_TEST_KERNEL")


def cached(folder) -> list[str]:
    """The files in the kernels' folder."""
    return sorted(os.listdir(folder))


@needs_cc
def test_a_library_is_built_once_sealed_and_then_loaded(library):
    path = library.path()
    assert library.load().seven() == 7
    name = os.path.basename(path)
    assert cached(os.path.dirname(path)) == [name, name + cache.SEAL]  # no temporary left
    with open(path + cache.SEAL) as f:
        assert json.load(f)["size"] == os.path.getsize(path)
    stamp = os.stat(path).st_mtime_ns
    assert library.load().seven() == 7 and os.stat(path).st_mtime_ns == stamp  # loaded, not built again


@needs_cc
@pytest.mark.parametrize("damage", ["truncated", "garbage", "unsealed"])
def test_a_damaged_library_is_built_again_before_it_is_mapped(library, damage):
    """Half the file (a link cut short by a full disk: mapping it is a SIGBUS), as many garbage bytes (found by
    the digest), or no seal: the next load builds it again, and only then maps it."""
    path = library.path()
    cache.build_once(path, lambda: library._build(path))  # built and sealed, not mapped by this process
    good = os.path.getsize(path)
    if damage == "unsealed":
        os.unlink(path + cache.SEAL)
    else:
        forked.damage(path, damage)
    assert not cache.intact(path)
    assert forked.exit_status(lambda: library.load().seven() == 7) == 0  # a SIGBUS there is -7, not a dead run
    assert cache.intact(path) and os.path.getsize(path) == good


def test_a_seal_that_does_not_match_is_not_intact(tmp_path):
    path = str(tmp_path / "k.so")
    assert not cache.intact(path)  # nothing there
    with open(path, "wb") as f:
        f.write(b"built bytes")
    assert not cache.intact(path)  # no seal
    cache.seal(path)
    assert cache.intact(path) and cached(tmp_path) == ["k.so", "k.so" + cache.SEAL]
    with open(path, "r+b") as f:
        f.write(b"B")  # same size, other bytes
    assert not cache.intact(path)
    for record in ("{not json", "[1, 2]", '{"size": "11"}'):
        cache.seal(path)
        with open(path + cache.SEAL, "w") as f:
            f.write(record)
        assert not cache.intact(path)
    cache.discard(path)
    cache.discard(path)  # nothing left to remove is fine
    assert cached(tmp_path) == []


def test_a_failed_build_leaves_no_seal_and_the_next_call_builds_again(tmp_path):
    path = str(tmp_path / "k.so")

    def broken():
        with open(path, "wb") as f:
            f.write(b"half")
        raise RuntimeError("the linker stopped")

    with pytest.raises(RuntimeError, match="linker"):
        cache.build_once(path, broken)
    assert not cache.intact(path)
    assert cache.build_once(path, lambda: open(path, "wb").close() or "built") == "built"
    assert cache.intact(path) and cache.build_once(path, lambda: "again") is None


def test_a_second_builder_waits_for_the_first_and_builds_nothing(tmp_path):
    """Two builders of one entry (two processes starting on a fresh machine): the folder's lock holds the second
    until the first has sealed the file, which it then loads as it is."""
    path = str(tmp_path / "k.so")
    builds, second = [], []

    def build(tag):
        builds.append(tag)
        if tag == "first":
            waiter = threading.Thread(target=lambda: second.append(cache.build_once(path, lambda: build("second"))))
            waiter.start()
            waiter.join(timeout=0.5)  # it cannot get past the lock while this build runs
            assert waiter.is_alive()
            second.append(waiter)
        with open(path, "wb") as f:
            f.write(tag.encode())

    cache.build_once(path, lambda: build("first"))
    second[0].join()
    assert builds == ["first"] and second[1] is None and open(path, "rb").read() == b"first"
    assert cached(tmp_path) == ["k.so", "k.so" + cache.SEAL]


def test_without_a_compiler_nothing_is_cached(library, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert library.load() is None
    assert cached(os.path.dirname(library.path())) == []
    monkeypatch.setenv("RPCOMPILE_TEST_KERNEL", "0")
    assert library.load() is None

