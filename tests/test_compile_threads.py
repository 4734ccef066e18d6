"""plugins/compile_threads.py: kernels compile in threads, and Triton's front end parses each
kernel with ast.parse, which CPython does not make safe across threads."""

import ast
import gc
import threading
import time

import pytest

from ingot.plugins.compile_threads import map_in_threads, serial_ast_parse

# a module big enough that building its AST allocates past a gc threshold several times
_SOURCE = "\n".join(
    f"def f{i}(a, b):\n    return [(a + b * {i}) if a else b for _ in range(3)]" for i in range(200)
)


class _Cycle:
    """Cyclic garbage whose finalizer yields the GIL: a collection that runs mid-parse lets
    another thread parse then, as any finalizer that waits on I/O would."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(0.0005)


def _parse_with_garbage(_: int) -> str | None:
    for _ in range(10):
        _Cycle(), _Cycle()
        try:
            ast.parse(_SOURCE)
        except SystemError as e:  # "AST constructor recursion depth mismatch"
            return str(e)
    return None


@pytest.fixture
def frequent_gc():
    before = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    yield
    gc.set_threshold(*before)


def test_threads_parse_one_at_a_time(monkeypatch, frequent_gc):
    """Without the lock this fails in well under a second (a CI cross-build failed so)."""
    monkeypatch.setenv("INGOT_COMPILE_THREADS", "4")
    parse = ast.parse
    assert map_in_threads(_parse_with_garbage, range(4)) == [None] * 4
    assert ast.parse is parse  # put back once the threads are done


def test_overlapping_blocks_restore_ast_parse_once_the_last_closes():
    parse = ast.parse
    opened, release = threading.Event(), threading.Event()

    def other_build():
        with serial_ast_parse():
            opened.set()
            release.wait(5)

    t = threading.Thread(target=other_build)
    with serial_ast_parse():
        locked = ast.parse
        assert locked is not parse
        t.start()
        assert opened.wait(5)
    assert ast.parse is locked  # the other build's block is still open
    assert isinstance(ast.parse("x = 1"), ast.Module)
    release.set()
    t.join(5)
    assert ast.parse is parse
