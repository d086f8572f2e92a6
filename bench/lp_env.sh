# Sourced by the benchmarks that run bench/lp_bound.py: sets lp_py to a Python with scipy, the
# project's venv (TIDAL_VENV, default .venv), installing scipy there for the benchmarks only (it
# is not a tidal dependency).
lp_venv=${TIDAL_VENV:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv}
lp_py=$lp_venv/bin/python
[ -x "$lp_py" ] || { echo "no Python at $lp_py: run scripts/setup.sh or set TIDAL_VENV" >&2; exit 1; }
if ! "$lp_py" -c 'import scipy.optimize' >/dev/null 2>&1; then
  echo "installing scipy into $lp_venv for the LP bound (a benchmark tool, not a tidal dependency)" >&2
  "$lp_venv/bin/pip" install --quiet scipy
fi
