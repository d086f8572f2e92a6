"""A linear-programme relaxation of offloading one iteration, to see how loose tidal's stall
bound is (docs/simulator.md, "How loose is the bound: an LP relaxation").

    python bench/lp_bound.py TRACE.json SIMULATE.json [--segments S] [--by-unit OUT [--per-op CSV]]
    python bench/lp_bound.py [--segments S] [--by-unit OUT] --simulate TIDAL simulate ARGS...

TRACE.json is `tidal simulate --save-trace`'s trace and SIMULATE.json the last line of the same
`tidal simulate --json` run (the hardware, the window bound and tidal's result); --simulate runs
the command given with those two flags. Prints one JSON line: the LP's least iteration, with
tidal's and the window bound's beside it. TIDAL_LP_METHOD: scipy's solver (highs-ipm; highs-ds
found the same optima 2-20x slower).

--by-unit OUT writes the LP's solution unit by unit (JSON lines: its stall, the GB each channel
moves by tensor class, what is away at the sample by class) beside tidal's plan over the same
ops (its stall and each channel's busy seconds, from `tidal simulate --per-op`: with --simulate
the script asks for it; with TRACE.json give the CSV as --per-op): where tidal loses against the
LP, and on which channel.

The relaxation. The ops are cut into S segments of equal compute; in each, the op with the most
live bytes (everything kept) is its sample, the only op whose memory is checked. Each segment is
two units of time: A, its ops up to and with its sample, and B, the ops after it. Between two uses
a < b of a tensor (wrapping over the iteration's end for persistent tensors: a periodic schedule),
at each sample k with a < k < b, any share z of its bytes may be away, in host memory or on the
SSDs; then
  - z <= the bytes of this version of the tensor written to that tier in the units from the one
    of its last modification to k's A (a tensor unchanged since its last write is not written
    again); in host memory, plus those staged from the SSDs in those units (tidal's stage: an
    SSD-to-host copy over the SSD read channel, at most what was written to the SSDs by then);
  - z <= the bytes of it read from that tier in the units from k's B to b's;
  - the live bytes at k less everything away there <= device memory; what is away in host
    memory <= host memory;
  - in each unit, each channel moves at most its rate x (the unit's compute + its stall).
The least total stall is a lower bound of every plan's periodic iteration: a plan's own
residency, writes and reads give a solution (its transfers fall in the units where they run,
and its stalls in theirs; a tensor away while op k runs was written before op k started and is
read after it ended, as a tensor being moved holds its device memory), and every constraint above
only forgets some of what a plan must do (when in a unit a transfer runs, the memory of the ops
between samples, the bytes in flight). The two units per segment (session 16) made the LP of
Llama3-8B b32 with one SSD 66.1% of ideal at 48 segments instead of 72.2% (384 segments of one
unit: 67.6%), in 2 s instead of 18 min.
Tensors with the same uses at segment granularity are merged (the LP is linear in bytes).
Needs scipy (HiGHS); bench/lp_bound.sh installs it for this benchmark only.
"""
import argparse
import collections
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

GB = 1e9  # the LP works in GB and seconds: bytes and GB/s of 1e10 scale made HiGHS misreport


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("simulate_json", nargs="?")
    ap.add_argument("--segments", type=int, default=48)
    ap.add_argument("--by-unit", help="write the LP's solution and tidal's plan unit by unit here")
    ap.add_argument("--per-op", help="with TRACE.json and --by-unit: tidal's `simulate --per-op` CSV")
    ap.add_argument("--simulate", nargs=argparse.REMAINDER,
                    help="instead of TRACE and SIMULATE.json: a `tidal simulate` command line "
                         "(with tidal in --policy), run here with --save-trace and --json")
    a = ap.parse_args()
    if a.simulate:
        cmd = [x for x in a.simulate if x != "--"]
        if "--json" not in cmd:
            cmd.append("--json")
        auto = "auto" in cmd and cmd.index("auto") > 0 and cmd[cmd.index("auto") - 1] == "--micro-batch-order"
        if auto and a.by_unit:
            ap.error("--by-unit needs one order: give --micro-batch-order sequential or layer-major")
        if auto:
            # A choice between two orders is bounded by the lower of the two orders' bounds (each
            # holds only for plans of its own order): the LP of each, and the looser kept.
            i = cmd.index("auto")
            runs = [simulate_and_bound(cmd[:i] + [o] + cmd[i + 1:], a.segments)
                    for o in ("sequential", "layer-major")]
            out = dict(min(runs, key=lambda r: r["lp_iteration_seconds"]))
            out["lp_orders"] = {o: r for o, r in zip(("sequential", "layer-major"), runs)}
            out["tidal_beats_lp"] = any(r["tidal_beats_lp"] for r in runs)
            print(json.dumps(out))
        else:
            print(json.dumps(simulate_and_bound(cmd, a.segments, a.by_unit)))
        return
    if not a.trace or not a.simulate_json:
        ap.error("give TRACE and SIMULATE.json, or --simulate")
    print(json.dumps(bound(a.trace, a.simulate_json, a.segments, a.by_unit, a.per_op)))


def simulate_and_bound(cmd, segments, by_unit=None):
    with tempfile.TemporaryDirectory() as tmp:
        trace, sim_json, per_op = f"{tmp}/trace.json", f"{tmp}/simulate.json", f"{tmp}/ops.csv"
        extra = ["--save-trace", trace] + (["--per-op", per_op] if by_unit else [])
        p = subprocess.run(cmd + extra, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed: {p.stderr.strip()[-300:]}")
        open(sim_json, "w").write(p.stdout.strip().splitlines()[-1])
        return bound(trace, sim_json, segments, by_unit, per_op if by_unit else None)


def bound(trace_path, sim_path, segments, by_unit=None, per_op=None):
    tr = json.load(open(trace_path))
    sim = json.load(open(sim_path))
    hw = sim["hardware"]
    cap = hw["device_memory"] / GB
    host_cap = hw["host_memory"] / GB
    ssd_r = hw["ssd_count"] * hw["ssd_read_bw"] / GB
    ssd_w = hw["ssd_count"] * hw["ssd_write_bw"] / GB
    # As Hardware::channels(): host memory gets the link the SSDs leave, only with a budget.
    host_r = max(0.0, hw["host_link_bw"] / GB - ssd_r) if host_cap > 0 else 0.0
    host_w = max(0.0, hw["host_link_bw"] / GB - ssd_w) if host_cap > 0 else 0.0
    t0 = time.time()
    stall, segs = lp_stall(tr, segments, cap, host_cap,
                           {"rS": ssd_r, "wS": ssd_w, "rH": host_r, "wH": host_w},
                           (by_unit, per_op) if by_unit else None)
    compute = sim["compute_seconds"]
    tidal = sim["policies"].get("tidal", {})
    return {
        "model": sim.get("model"), "batch": sim.get("batch"), "seq": sim.get("seq"),
        "segments": segs, "compute_seconds": compute,
        "lp_iteration_seconds": compute + stall,
        "lp_fraction_of_ideal": compute / (compute + stall),
        "window_bound_fraction_of_ideal": sim["lower_bound"]["fraction_of_ideal"],
        "window_bound_iteration_seconds": sim["lower_bound"]["iteration_seconds"],
        "tidal_fraction_of_ideal": tidal.get("fraction_of_ideal"),
        "tidal_iteration_seconds": tidal.get("iteration_seconds"),
        "tidal_fits": tidal.get("fits"),
        "lp_seconds": time.time() - t0,
        # A plan of this trace shorter than the LP's least iteration: a bug in one of the two.
        "tidal_beats_lp": bool(tidal.get("fits")) and
        tidal.get("iteration_seconds", float("inf")) < (compute + stall) * (1 - 1e-6),
    }


def op_times(ops):
    n = len(ops)
    d = np.zeros(n)
    for k in range(n):
        nxt = ops[k + 1]["start_s"] if k + 1 < n else ops[k]["end_s"]
        d[k] = max(0.0, nxt - ops[k]["start_s"])
    return d


def lp_stall(tr, S, cap, host_cap, rates, by_unit=None):
    ops, tensors = tr["ops"], tr["tensors"]
    n = len(ops)
    d = op_times(ops)
    uses = [set() for _ in tensors]
    mods = [set() for _ in tensors]
    for k, o in enumerate(ops):
        for t in o["inputs"]:
            uses[t].add(k)
        for t in o["outputs"]:
            uses[t].add(k)
            mods[t].add(k)
    # Live bytes per op with everything kept, as the simulator counts them.
    live = np.array([o.get("workspace_bytes", 0) / GB for o in ops])
    ranges = []
    for i, t in enumerate(tensors):
        u = sorted(uses[i])
        b = t["bytes"] / GB
        if not u or b == 0:
            ranges.append(None)
            continue
        if t["persistent"] and t["freed_after"] == -1:
            live += b
            ranges.append((0, n - 1, True))
            continue
        if t["persistent"]:  # alive over [producer, end) and [0, freed_after]
            beg, end = t["producer"], t["freed_after"] + n
        else:
            beg = t["producer"] if t["producer"] != -1 else u[0]
            end = t["freed_after"] if t["freed_after"] != -1 else u[-1]
        for k in range(beg, end + 1):
            live[k % n] += b
        ranges.append((beg, end, False))
    total = d.sum()
    starts = np.concatenate([[0.0], np.cumsum(d)[:-1]])
    seg_of = np.minimum((starts / total * S).astype(int), S - 1)
    seg_of = np.unique(seg_of, return_inverse=True)[1]  # an op longer than a segment leaves gaps
    S = int(seg_of.max()) + 1
    sample = np.zeros(S, dtype=int)
    for s in range(S):
        ks = np.nonzero(seg_of == s)[0]
        sample[s] = ks[np.argmax(live[ks])]
    # Each segment is two units of time: A, its ops up to its sample, and B, those after it. A
    # share away at a sample was written in A or before, and is read in B or after (a tensor
    # being moved is in device memory); the channels' time is per unit.
    U = 2 * S
    unit_of_op = 2 * seg_of + (np.arange(n) > sample[seg_of]).astype(int)
    unit_time = np.bincount(unit_of_op, weights=d, minlength=U)
    need = np.maximum(0.0, live[sample] - cap)

    def cpos(k):  # 3 x (unwrapped segment) + 0 before its sample, 1 at it, 2 after it
        w, kk = divmod(k, n)
        s = seg_of[kk]
        return 3 * (w * S + s) + (0 if kk < sample[s] else 1 if kk == sample[s] else 2)

    groups = collections.defaultdict(float)
    for i, t in enumerate(tensors):
        if ranges[i] is None:
            continue
        beg, end, full = ranges[i]
        u = sorted(uses[i])
        ms = sorted(mods[i])
        if full:
            uu = u + [u[0] + n]
            mods_unwrapped = [m - n for m in ms] + ms
        else:
            uu = sorted(x if x >= beg else x + n for x in u)
            uu = [x for x in uu if beg <= x <= end]
            mods_unwrapped = sorted(m if m >= beg else m + n for m in ms)
        sig = []
        for j in range(len(uu) - 1):
            pa, pb = uu[j], uu[j + 1]
            if pb - pa <= 1:
                continue
            v = max((m for m in mods_unwrapped if m <= pa), default=None)
            sig.append((cpos(pa), cpos(pb), None if v is None else cpos(v)))
        if sig:
            # With --by-unit the classes stay apart, to say what each channel moves.
            groups[(tuple(sig), t["class"] if by_unit else "")] += t["bytes"] / GB

    # Columns: stall per unit, then per group the writes, reads and shares away.
    ncol = U

    def unit(cp):  # the unit of a position (cpos): at or before its segment's sample, A
        return 2 * (cp // 3) + (0 if cp % 3 <= 1 else 1)
    rows_i, cols_i, vals = [], [], []
    rhs = []
    chan_cols = {c: [[] for _ in range(U)] for c in rates}
    mem_cols = [[] for _ in range(S)]
    host_cols = [[] for _ in range(S)]

    def new_col():
        nonlocal ncol
        ncol += 1
        return ncol - 1

    def add_row(entries, b):
        r = len(rhs)
        for c, v in entries:
            rows_i.append(r)
            cols_i.append(c)
            vals.append(v)
        rhs.append(b)

    # Reads and writes as running totals, so that each row has a few entries: Q[s], the bytes of a
    # period read from a tier in its segments s and later (never more at s than at s - 1), and
    # P[s], those of a version written to it up to segment s; a segment moves the differences.
    col_class = {}  # --by-unit: the tensor class of each group's columns
    for (sig, klass), size in groups.items():
        first_col = ncol
        periods = []
        write_end = {}  # version -> last segment whose sample needs its writes
        for pa, pb, pv in sig:
            sa, sb = pa // 3, pb // 3
            inside = [s for s in range(sa, sb + 1) if pa < 3 * s + 1 < pb]
            if not inside:
                continue
            periods.append((inside, unit(pb), pv))
            if pv is not None:
                write_end[pv] = max(write_end.get(pv, 2 * inside[-1]), 2 * inside[-1])
        written = {}  # (version, tier) -> {segment: column of P}
        for pv, last in write_end.items():
            for tier in "SH":
                cols = {x: new_col() for x in range(unit(pv), last + 1)}
                written[pv, tier] = cols
                for x, c in cols.items():
                    chan_cols["w" + tier][x % U].append((c, 1.0))
                    if x - 1 in cols:
                        chan_cols["w" + tier][x % U].append((cols[x - 1], -1.0))
                        add_row([(cols[x - 1], 1.0), (c, -1.0)], 0.0)
        for inside, ub, pv in periods:
            # A stage (tidal's SSD-to-host copy): host memory may hold a share that came from
            # the SSDs, over their read channel, in the units from the version's to the last
            # sample's A, at most what was written to the SSDs up to then (G[x], cumulative).
            staged = {}
            if pv is not None:
                staged = {x: new_col() for x in range(unit(pv), 2 * inside[-1] + 1)}
                for x, c in staged.items():
                    chan_cols["rS"][x % U].append((c, 1.0))
                    add_row([(c, 1.0), (written[pv, "S"][x], -1.0)], 0.0)
                    if x - 1 in staged:
                        chan_cols["rS"][x % U].append((staged[x - 1], -1.0))
                        add_row([(staged[x - 1], 1.0), (c, -1.0)], 0.0)
            read = {}
            for tier in "SH":
                cols = {x: new_col() for x in range(2 * inside[0] + 1, ub + 1)}
                read[tier] = cols
                for x, c in cols.items():
                    chan_cols["r" + tier][x % U].append((c, 1.0))
                    if x + 1 in cols:
                        chan_cols["r" + tier][x % U].append((cols[x + 1], -1.0))
                        add_row([(cols[x + 1], 1.0), (c, -1.0)], 0.0)
            for x in inside:
                zs = []
                for tier in "SH":
                    z = new_col()
                    zs.append(z)
                    add_row([(z, 1.0), (read[tier][2 * x + 1], -1.0)], 0.0)
                    if pv is not None:
                        came = [(written[pv, tier][2 * x], -1.0)]
                        if tier == "H":
                            came.append((staged[2 * x], -1.0))
                        add_row([(z, 1.0)] + came, 0.0)
                    mem_cols[x % S].append(z)
                    if tier == "H":
                        host_cols[x % S].append(z)
                add_row([(z, 1.0) for z in zs], size)
        col_class.update((c, klass) for c in range(first_col, ncol))
    for c, rate in rates.items():
        for u in range(U):
            add_row(chan_cols[c][u] + [(u, -rate)], rate * unit_time[u])
    for s in range(S):
        if need[s] > 0:
            add_row([(z, -1.0) for z in mem_cols[s]], -need[s])
        if host_cols[s]:
            add_row([(z, 1.0) for z in host_cols[s]], host_cap)
    A = sp.csr_matrix((vals, (rows_i, cols_i)), shape=(len(rhs), ncol))
    cost = np.zeros(ncol)
    cost[:U] = 1.0
    res = linprog(cost, A_ub=A, b_ub=np.array(rhs), bounds=(0, None), method=os.environ.get("TIDAL_LP_METHOD", "highs-ipm"))
    if res.status != 0:
        sys.exit(f"the LP did not solve: {res.message}")
    print(f"LP: {len(groups)} tensor groups, {ncol} columns, {len(rhs)} rows", file=sys.stderr)
    if by_unit:
        write_by_unit(by_unit, ops, res.x, U, unit_of_op, unit_time, sample, rates, chan_cols,
                      mem_cols, col_class)
    return float(res.fun), S


def write_by_unit(by_unit, ops, x, U, unit_of_op, unit_time, sample, rates, chan_cols, mem_cols,
                  col_class):
    out, per_op = by_unit
    tidal = None
    if per_op:
        tidal = np.zeros((U, 5))  # stall, then busy seconds: ssd write, ssd read, host write, host read
        cols = ("stall_s", "ssd_write_busy_s", "ssd_read_busy_s", "host_write_busy_s", "host_read_busy_s")
        with open(per_op) as f:
            for r in csv.DictReader(f):
                tidal[unit_of_op[int(r["op"])]] += [float(r[c]) for c in cols]
    with open(out, "w") as f:
        for u in range(U):
            first = int(np.nonzero(unit_of_op == u)[0][0]) if (unit_of_op == u).any() else None
            row = {"unit": u, "segment": u // 2, "part": "AB"[u % 2],
                   "first_op": ops[first]["name"] if first is not None else None,
                   "compute_s": unit_time[u], "lp_stall_s": x[u]}
            for c in rates:
                by = collections.defaultdict(float)
                for col, coef in chan_cols[c][u]:
                    by[col_class[col]] += coef * x[col]
                row["lp_" + c + "_gb"] = {k: round(v, 3) for k, v in by.items() if abs(v) > 1e-3}
            if u % 2 == 0:  # the sample is in part A
                by = collections.defaultdict(float)
                for z in mem_cols[u // 2]:
                    by[col_class[z]] += x[z]
                row["sample_op"] = ops[sample[u // 2]]["name"]
                row["lp_away_gb"] = {k: round(v, 3) for k, v in by.items() if abs(v) > 1e-3}
            if tidal is not None:
                row["tidal_stall_s"] = tidal[u][0]
                row.update(zip(("tidal_ssd_write_busy_s", "tidal_ssd_read_busy_s",
                                "tidal_host_write_busy_s", "tidal_host_read_busy_s"), tidal[u][1:]))
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
