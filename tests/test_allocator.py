"""maskprior keeps freed memory in the process (glibc's mallopt), so a step's tensors reuse pages."""

import platform
import subprocess
import sys
import textwrap

import pytest

from lightning_maskprior.run import allocator, cli

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Where a 48 MiB tensor's memory comes from, and whether freeing it gives the heap back (sbrk(0) is the heap's end).
HEAP_PROBE = textwrap.dedent("""
    import ctypes, sys, torch
    from lightning_maskprior.run import allocator
    if sys.argv[1] == "keep":
        assert allocator.keep_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.sbrk.restype = ctypes.c_void_p
    tensor = torch.ones(12 << 20)
    in_heap = tensor.data_ptr() < libc.sbrk(0)
    end = libc.sbrk(0)
    del tensor
    print(in_heap, libc.sbrk(0) == end)
""")


def _heap_probe(mode: str) -> tuple[bool, bool]:
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True, check=True)
    in_heap, kept = out.stdout.split()
    return in_heap == "True", kept == "True"


@pytest.mark.skipif(not GLIBC, reason="mallopt thresholds are glibc's")
def test_large_tensors_come_from_the_heap_and_stay_there_once_freed():
    # glibc's default: a block this large is mmap'ed, and munmap'ed when freed; its pages are fresh every time.
    assert _heap_probe("default")[0] is False
    # Kept: the block comes from the heap, and freeing it does not shrink the heap, so the next one reuses it.
    assert _heap_probe("keep") == (True, True)


@pytest.mark.parametrize("value, expected", [("1", True), ("", True), ("on", True), ("0", False),
                                             ("False", False), (" off ", False), ("no", False)])
def test_the_environment_switch(monkeypatch, value, expected):
    monkeypatch.setenv(allocator.ENV, value)
    assert allocator.enabled_by_environment() is expected


def test_the_switch_is_on_when_unset(monkeypatch):
    monkeypatch.delenv(allocator.ENV, raising=False)
    assert allocator.enabled_by_environment() is True


def test_a_bad_switch_value_is_named(monkeypatch):
    monkeypatch.setenv(allocator.ENV, "maybe")
    with pytest.raises(ValueError, match=r"MASKPRIOR_KEEP_FREED_MEMORY='maybe': expected 1 or 0"):
        allocator.enabled_by_environment()


def test_a_non_positive_threshold_is_refused():
    with pytest.raises(ValueError, match="positive number of bytes, got 0"):
        allocator.keep_freed_memory(0)


@pytest.mark.parametrize("value, calls", [(None, 1), ("0", 0)])
def test_the_cli_keeps_freed_memory_unless_switched_off(monkeypatch, value, calls):
    seen = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: seen.append(True) or True)
    if value is None:
        monkeypatch.delenv(allocator.ENV, raising=False)
    else:
        monkeypatch.setenv(allocator.ENV, value)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--help"])
    assert exit_.value.code == 0
    assert len(seen) == calls


def test_the_cli_names_a_bad_switch_value(monkeypatch, capsys):
    monkeypatch.setenv(allocator.ENV, "2")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--help"])
    assert exit_.value.code == 2
    assert "MASKPRIOR_KEEP_FREED_MEMORY='2'" in capsys.readouterr().err
