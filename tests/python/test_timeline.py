"""The timeline of a Python run (tidal.Session(timeline=...), write_timeline, time_report): on an
ordinary loop it has its lanes and counters, keeps every transfer within its step and every miss
the stats counted, leaves the losses as they were, and its report adds up; with a slow store,
the report names the store as the limit."""

import json

import pytest
import torch

import tidal
from conftest import batches, train_mlp

STEPS = 7


def load(path):
    doc = json.load(open(path))
    events = doc["traceEvents"]
    steps = {e["args"]["step"]: e for e in events if e.get("cat") == "step"}
    return doc, events, steps


def check_timeline(path, stats, keep):
    doc, events, steps = load(path)
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"steps", "ops (stalls nested)"} <= lanes, lanes
    assert any(name.startswith("I/O SSD") for name in lanes), lanes
    assert len(steps) == keep, sorted(steps)
    misses = dict.fromkeys(steps, 0)
    for e in events:
        if e.get("cat") != "transfer":
            continue
        s = steps[e["args"]["step"]]
        assert s["ts"] - 1 <= e["ts"] <= e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1, (e, s)
        if e["args"]["kind"] == "miss" and not e["args"].get("between_steps"):
            misses[e["args"]["step"]] += 1
    # The stats of the kept steps (the last ones) count the same misses.
    for (step, e), st in zip(sorted(steps.items()), stats[-keep:]):
        assert misses[step] == e["args"]["misses"] == st.misses, (step, misses, st.misses)
    windows = {s: (e["ts"], e["ts"] + e["dur"], e["args"]["peak_bytes"]) for s, e in steps.items()}
    samples = 0
    for e in events:
        if e["ph"] == "C" and e["name"] == "memory":
            samples += 1
            peak = next(p for lo, hi, p in windows.values() if lo - 1 <= e["ts"] <= hi + 1)
            assert e["args"]["in_use"] <= peak, (e, peak)
    assert samples > 0
    return doc


def test_plan_mode_timeline_on_an_ordinary_loop(tmp_path, store_dir):
    data = batches(seed=1, steps=STEPS)
    ref_losses, _, _ = train_mlp(data)
    path = tmp_path / "run.json"
    holder = {}

    def session(model, opt):
        holder["s"] = tidal.Session("plan", dirs=[store_dir], budget="50%", model=model,
                                    optimizer=opt, strict=True, min_bytes="64KiB",
                                    timeline_steps=3, timeline=path)
        return holder["s"]

    losses, _, stats = train_mlp(data, session)
    assert torch.equal(losses, ref_losses)  # recording changes nothing
    s = holder["s"]
    report = s.time_report()
    s.write_timeline(tmp_path / "run.svg")
    s.close()
    assert path.exists()  # written at close
    check_timeline(path, stats, keep=3)
    assert report["steps"] == 3 and abs(report["accounted"] - 1) < 0.05, report
    assert report["bytes"]["ssd-write"] > 0 and report["limit"], report
    assert "where the time went" in report["text"]
    assert (tmp_path / "run.svg").read_text().startswith("<svg")
    # A closed session still reports.
    assert s.time_report()["limit"] == report["limit"]


def test_activation_mode_timeline_marks_the_phases(tmp_path, store_dir):
    data = batches(seed=2, steps=5)
    holder = {}

    def session(model, opt):
        holder["s"] = tidal.Session("activations", dirs=[store_dir], model=model, optimizer=opt,
                                    adaptive=False, min_bytes="64KiB", timeline_steps=2)
        return holder["s"]

    _, _, stats = train_mlp(data, session)
    s = holder["s"]
    s.write_timeline(tmp_path / "act.json")
    report = s.time_report()
    s.close()
    doc = check_timeline(tmp_path / "act.json", stats, keep=2)
    ops = {e["name"] for e in doc["traceEvents"] if e.get("cat") == "op"}
    assert {"forward", "backward"} <= ops, ops  # found by the offloader: the loop marks nothing
    kinds = {e["args"]["kind"] for e in doc["traceEvents"] if e.get("cat") == "transfer"}
    assert "activation" in kinds, kinds
    assert report["steps"] == 2 and abs(report["accounted"] - 1) < 0.05, report
    assert report["compute_seconds"] > 0


def test_a_slow_store_is_named_as_the_limit(store_dir):
    # Every store request waits 30 ms (a fault plan's delay): the disk, not compute, limits, even
    # on a loaded machine where compute takes 30 times as long (as under a parallel build).
    data = batches(seed=3, steps=5)
    holder = {}

    def session(model, opt):
        holder["s"] = tidal.Session("plan", dirs=[store_dir], budget="50%", model=model,
                                    optimizer=opt, strict=True, min_bytes="64KiB",
                                    _faults={"delay_us": 30000})
        return holder["s"]

    train_mlp(data, session)
    report = holder["s"].time_report()
    holder["s"].close()
    assert report["stall_seconds"] > 0.05 * report["step_seconds"], report
    assert report["limit"].startswith(("SSD reads", "writes under the budget")), report["limit"]
    assert "store delivered" in report["limit"], report["limit"]


def test_no_timeline_is_a_clear_error(tmp_path, store_dir):
    with tidal.Session("plan", dirs=[store_dir], timeline_steps=0) as s:
        assert s.time_report()["steps"] == 0
        with pytest.raises(tidal.InvalidArgument, match="timeline_steps"):
            s.write_timeline(tmp_path / "x.json")
    with pytest.raises(tidal.InvalidArgument, match="timeline_steps"):
        tidal.Session("plan", dirs=[store_dir], timeline_steps=-1)
