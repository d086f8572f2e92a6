"""Bad input reaches Python as tidal's exceptions, with the C++ message and the option named."""

import os
import re
import time

import pytest
import torch

import tidal


def test_exception_hierarchy():
    assert issubclass(tidal.InvalidArgument, tidal.Error)
    assert issubclass(tidal.InvalidArgument, ValueError)
    assert issubclass(tidal.IoError, tidal.Error)
    assert issubclass(tidal.IoError, OSError)
    assert issubclass(tidal.Error, RuntimeError)


def test_bad_directory(store_dir):
    missing = os.path.join(store_dir, "does", "not", "exist")
    with pytest.raises(tidal.Error, match="does/not/exist"):
        tidal.Session(mode="plan", dirs=[missing], capacity="64MiB")
    with pytest.raises(tidal.Error, match="does/not/exist"):
        tidal.offload_activations(dirs=[missing], capacity="64MiB")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_memory_filesystem_is_refused():
    with pytest.raises(tidal.InvalidArgument, match="memory"):
        tidal.Session(mode="activations", dirs=["/dev/shm"], capacity="64MiB")


def test_no_directory(monkeypatch):
    monkeypatch.delenv("TIDAL_DIRS", raising=False)
    with pytest.raises(tidal.InvalidArgument, match="TIDAL_DIRS"):
        tidal.Session(mode="plan")


@pytest.mark.parametrize("budget, words", [
    ("lots", "budget"),
    ("150%", "percentage"),
    ("0%", "percentage"),
    (1.5, r"\(0, 1\]"),
    (0, "budget=0"),
    ([1], "budget"),
])
def test_bad_budget(store_dir, budget, words):
    with pytest.raises(tidal.InvalidArgument, match=words):
        tidal.Session(mode="plan", dirs=[store_dir], budget=budget, capacity="64MiB")


def test_budget_as_a_bare_fraction_string_is_the_fraction():
    # "0.5" meant 1 byte (a size, rounded) while 0.5 meant 50%, and "0.4" was refused as budget=0.
    from tidal._options import parse_budget
    for text, fraction in [("0.5", 0.5), (" 0.4 ", 0.4), (".25", 0.25), ("1.0", 1.0)]:
        assert parse_budget(text) == parse_budget(fraction) == (0, fraction), text
    assert parse_budget("50%") == (0, 0.5)
    assert parse_budget("1GiB") == (1 << 30, 0.5)
    assert parse_budget("4096") == (4096, 0.5)  # no decimal point: bytes, as before
    with pytest.raises(tidal.InvalidArgument, match=r"\(0, 1\]"):
        parse_budget("2.5")


def test_bad_sizes_and_mode(store_dir):
    with pytest.raises(tidal.InvalidArgument, match="host_memory"):
        tidal.Session(mode="plan", dirs=[store_dir], host_memory="8 gigs")
    with pytest.raises(tidal.InvalidArgument, match="unknown offload mode 'fast'"):
        tidal.Session(mode="fast", dirs=[store_dir])
    with pytest.raises(tidal.InvalidArgument, match="between_steps"):
        tidal.Session(mode="plan", dirs=[store_dir], between_steps="elsewhere")
    with pytest.raises(tidal.InvalidArgument, match="min_bytes"):
        tidal.offload_activations(dirs=[store_dir], min_bytes=-1)
    with pytest.raises(tidal.InvalidArgument):
        tidal.parse_bytes("12 parsecs")
    assert tidal.parse_bytes("1.5GiB") == 3 << 29


def test_an_error_message_formats_its_numbers():
    # tidal's messages end with "(at file.cpp:LINE)", written with the C++ library's number
    # formatting. A module that carried its own static copy of libstdc++ beside the one torch
    # loads lost the numbers (here) or crashed (Ubuntu 24.04 with a GPU) at the first one.
    with pytest.raises(tidal.InvalidArgument) as info:
        tidal.parse_bytes("12 parsecs")
    assert re.search(r"\(at [\w.]+\.cpp:[1-9][0-9]*\)$", str(info.value)), str(info.value)


def test_capacity_too_small_for_the_disk(store_dir):
    with pytest.raises(tidal.Error):
        tidal.Session(mode="plan", dirs=[store_dir], capacity=1 << 53)


def test_python_dash_m_tidal_runs_the_cli():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "tidal", "plan", "--trace", "/nonexistent.json"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    # The CLI's own error for a missing file, with its exit status.
    assert p.returncode != 0
    assert "nonexistent.json" in p.stdout


def test_store_dirs_per_rank(monkeypatch, store_dir):
    from tidal._options import store_dirs

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert store_dirs([store_dir + "/n{local_rank}/r{rank}"]) == [store_dir + "/n1/r3"]
    # Without a placeholder, a job of several ranks gets one subdirectory per rank, made here.
    assert store_dirs(store_dir) == [store_dir + "/rank3"]
    assert os.path.isdir(store_dir + "/rank3")
    # A user's own per-rank directory gets no second level.
    assert store_dirs([f"{store_dir}/mine/rank3"]) == [f"{store_dir}/mine/rank3"]
    monkeypatch.setenv("TIDAL_DIRS", f"{store_dir}/a{{rank}},{store_dir}/b{{rank}}")
    assert store_dirs(None) == [store_dir + "/a3", store_dir + "/b3"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert store_dirs([store_dir]) == [store_dir]


def test_an_empty_store_directory_is_named():
    for dirs in ("", [""], ["  "]):
        with pytest.raises(tidal.InvalidArgument, match="empty directory"):
            tidal.Session(mode="activations", dirs=dirs)


def test_backward_after_the_step_ended_says_so(store_dir):
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    session = tidal.Session(mode="activations", dirs=[store_dir], capacity="256MiB",
                            min_bytes="64KiB", adaptive=False, model=model)
    for _ in range(3):  # the warm-up and reference steps keep everything; the third writes
        session.begin_step()
        loss = model(torch.randn(128, 256)).sum()
        wait = 50
        while session.store_stats()["writes"] == 0 and wait:
            time.sleep(0.02)
            wait -= 1
        session.end_step()
    assert session.store_stats()["writes"] > 0, "nothing was written: the test would prove nothing"
    with pytest.raises(RuntimeError, match="after its step ended"):  # through autograd
        loss.backward()
    session.close()
