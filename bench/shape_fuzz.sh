#!/usr/bin/env bash
# Random decoder shapes in the simulator (model results, not measurements): for each shape,
# tidal's fraction of ideal against the lower bound of any plan, the share of shapes at or above
# 0.95 of the bound, the worst five, and the check that no plan beats the bound (a plan whose
# iteration is shorter than the bound's is a bug in one of the two, and fails the script).
#
#   bench/shape_fuzz.sh [OUT.jsonl]
#
# Each shape draws layers, hidden size (heads of 64 or 128), key/value heads, FFN width,
# vocabulary, batch, sequence, micro-batches, precision, tensor parallelism (1 or 2), SSDs per GPU
# (1-4) and host memory per GPU (0-1 TB) on the h100-4ssd preset, the optimizer step after
# backward. Environment: TIDAL_BIN (default ./build/tidal), TIDAL_FUZZ_SHAPES (200),
# TIDAL_FUZZ_SEED (1), TIDAL_FUZZ_MAX_LAYERS (48), TIDAL_FUZZ_ORDER (the micro-batch order of
# the shapes with micro-batches: sequential, the default; layer-major; auto: tidal plans both,
# keeps the faster, and its bound is the lower of the two orders'; the shapes drawn are the same
# whatever the order); TIDAL_FUZZ_LP=1: where a plan is under 0.95 of the bound, the LP
# relaxation of bench/lp_bound.py (TIDAL_LP_SEGMENTS, 48) too, a second lower bound, often the
# tighter one there: such a shape is then read against the tighter of the two, and a plan that
# beats the LP's fails the script as well (needs scipy: installs it into the venv, bench/lp_env.sh).
set -euo pipefail
bin=${TIDAL_BIN:-./build/tidal}
out=${1:-build/shape_fuzz.jsonl}
shapes=${TIDAL_FUZZ_SHAPES:-200}
seed=${TIDAL_FUZZ_SEED:-1}
max_layers=${TIDAL_FUZZ_MAX_LAYERS:-48}
order=${TIDAL_FUZZ_ORDER:-sequential}
[ -x "$bin" ] || { echo "no tidal binary at $bin: build first (scripts/build.sh)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
lp_py=""
if [ "${TIDAL_FUZZ_LP:-0}" = 1 ]; then
  # shellcheck source=bench/lp_env.sh
  source "$(dirname "$0")/lp_env.sh"
fi

python3 - "$bin" "$out" "$shapes" "$seed" "$max_layers" "$order" "$lp_py" \
  "$(dirname "$0")/lp_bound.py" "${TIDAL_LP_SEGMENTS:-48}" <<'EOF'
import json, os, random, subprocess, sys

bin_, out, shapes, seed, max_layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
order = sys.argv[6]
lp_py, lp_script, lp_segments = sys.argv[7], sys.argv[8], sys.argv[9]
rng = random.Random(seed)
sys.path.insert(0, os.path.dirname(os.path.abspath(lp_script)))  # bench/
from fuzz_shapes import draw, simulate_args

rows = []
bad = []
with open(out, "w") as f:
    for i in range(shapes):
        s = draw(rng, max_layers)
        cmd = [bin_, "simulate", *simulate_args(s, order), "--policy", "ideal,tidal",
               "--profile-steps", "0", "--json"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        row = dict(s, shape=i)
        if p.returncode != 0:
            row["error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
        else:
            j = json.loads(p.stdout.strip().splitlines()[-1])
            t = j["policies"]["tidal"]
            lb = j["lower_bound"]
            # No bound (null) where an op needs more than device memory by itself: no plan fits.
            bound = lb["fraction_of_ideal"]
            row.update(ideal_seconds=j["compute_seconds"], tidal=t["fraction_of_ideal"],
                       fits=t["fits"], bound=bound,
                       of_bound=t["fraction_of_ideal"] / bound if bound is not None else None,
                       planning_seconds=t.get("planning_seconds", 0.0),
                       order=j.get("micro_batch_order", "sequential"))
            # No plan that fits may beat the bound (1e-6 of slack for the sums' order), nor fit
            # where the bound says none does.
            if t["fits"] and (bound is None or
                              t["iteration_seconds"] < lb["iteration_seconds"] * (1 - 1e-6)):
                bad.append(row)
            if lp_py and t["fits"] and row["of_bound"] < 0.95:
                p = subprocess.run([lp_py, lp_script, "--segments", lp_segments, "--simulate"] + cmd,
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    row["lp_error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
                else:
                    lp = json.loads(p.stdout.strip().splitlines()[-1])
                    row.update(window_bound=row["bound"], lp_bound=lp["lp_fraction_of_ideal"],
                               lp_seconds=lp["lp_seconds"])
                    row["bound"] = min(row["bound"], lp["lp_fraction_of_ideal"])
                    row["of_bound"] = row["tidal"] / row["bound"]
                    if lp["tidal_beats_lp"]:
                        bad.append(row)
        rows.append(row)
        f.write(json.dumps(row) + "\n")
        if row.get("error"):
            said = row["error"]
        elif row["bound"] is None:
            said = f"no plan fits (op {lb['no_fit_op']} needs more than device memory by itself)"
        else:
            said = (f"tidal {100 * row['tidal']:.1f}%, bound {100 * row['bound']:.1f}%, "
                    f"{row['of_bound']:.3f} of the bound{'' if row['fits'] else ' (no fit)'}")
        print(f"shape {i}: {said}", file=sys.stderr)

ok = [r for r in rows if "error" not in r and r["fits"]]
errors = [r for r in rows if "error" in r]
no_fit = [r for r in rows if "error" not in r and r["bound"] is None]
print(f"{len(rows)} shapes (seed {seed}, micro-batch order {order}): {len(ok)} planned and fit, "
      f"{len(no_fit)} that no plan fits (an op needs more than device memory by itself), "
      f"{len(rows) - len(ok) - len(errors) - len(no_fit)} planned but do not fit, "
      f"{len(errors)} refused (an error)")
if ok:
    if lp_py:
        tight = [r for r in ok if "lp_bound" in r]
        print(f"the LP bound ran on the {len(tight)} plans under 0.95 of the window bound "
              f"({sum(r['lp_bound'] < r['window_bound'] for r in tight)} of them tighter: "
              "the tighter bound is used)")
    at95 = sum(r["of_bound"] >= 0.95 for r in ok)
    print(f"at or above 0.95 of the bound: {at95} of {len(ok)} ({100 * at95 / len(ok):.1f}%); "
          f"lowest {min(r['of_bound'] for r in ok):.3f}")
    print("\nthe worst 5 (fraction of the bound):\n")
    print("| shape | layers | hidden/heads/kv | ffn | vocab | batch x seq (micro) | precision | TP | SSDs | host | tidal | bound | of bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(ok, key=lambda r: r["of_bound"])[:5]:
        print(f"| {r['shape']} | {r['layers']} | {r['hidden']}/{r['heads']}/{r['kv_heads']} | {r['ffn']} | "
              f"{r['vocab']} | {r['batch']}x{r['seq']} ({r['micro_batches']}{', LM' if r['order'] == 'layer-major' else ''}) | {r['precision']} | "
              f"{r['tensor_parallel']} | {r['ssds']} | {r['host']} | {100 * r['tidal']:.1f}% | "
              f"{100 * r['bound']:.1f}% | {r['of_bound']:.3f} |")
print(f"\nplans that beat the bound: {len(bad)}; JSON lines in {out}")
for r in bad:
    print(f"  shape {r['shape']}: {json.dumps(r)}")
sys.exit(1 if bad else 0)
EOF
