#!/usr/bin/env bash
# The documented Python install, `pip install --no-build-isolation .` (README.md,
# docs/python.md), with the pip and packages of the project's environment (what
# scripts/requirements.txt installs: torch, pybind11, setuptools), into a scratch venv; then
# `import tidal` there with no PYTHONPATH, and the `tidal` command. The scratch venv sees the
# project venv's packages through a .pth file (torch is 5 GB: not copied) and gets tidal in its
# own site-packages. TIDAL_BUILD_DIR is this build, so pip's CMake build has nothing left to do.
# Second: a venv whose setuptools cannot build wheels is told what to install, not "invalid
# command 'bdist_wheel'".
#
#   tests/package/pip_install.sh SOURCE_DIR BUILD_DIR PYTHON
set -euo pipefail
src=$(cd "${1:?usage: pip_install.sh SOURCE_DIR BUILD_DIR PYTHON}" && pwd)
build=$(cd "${2:?usage: pip_install.sh SOURCE_DIR BUILD_DIR PYTHON}" && pwd)
python=${3:?usage: pip_install.sh SOURCE_DIR BUILD_DIR PYTHON}
tmp=$(mktemp -d /var/tmp/tidal-pip.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
unset PYTHONPATH
export TIDAL_BUILD_DIR=$build
fail() {
  echo "FAIL: $1"
  [ -f "${2:-}" ] && tail -n 15 "$2" | sed 's/^/    /'
  exit 1
}

# The package's sources: pip builds in the tree it is given and leaves its own files there.
mkdir -p "$tmp/src"
cp -r "$src/pyproject.toml" "$src/setup.py" "$src/python" "$tmp/src/"

site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
"$python" -m venv --without-pip "$tmp/venv"
site=$(site_of "$tmp/venv/bin/python")
site_of "$python" >"$site/project-venv.pth"
pip=("$tmp/venv/bin/python" -m pip install --no-build-isolation --no-deps --no-index -q
  --disable-pip-version-check)
"${pip[@]}" "$tmp/src" >"$tmp/pip.log" 2>&1 ||
  fail "pip install --no-build-isolation . failed" "$tmp/pip.log"
cd "$tmp"  # not beside a source tree
where=$("$tmp/venv/bin/python" -c 'import tidal; print(tidal.__file__)' 2>"$tmp/import.log") ||
  fail "import tidal after the install" "$tmp/import.log"
[[ $where == "$site"/* ]] || fail "tidal was imported from $where, not the venv's $site"
help=$("$tmp/venv/bin/tidal" --help 2>&1) || fail "the tidal command: $help"
grep -q "simulate" <<<"$help" || fail "tidal --help does not list its commands: $help"
echo "ok   pip install --no-build-isolation . into a venv: import tidal ($where), tidal --help"

# A venv as Python makes it (Debian's: pip 23 and setuptools 66, no `wheel`): setup.py says
# what to install, where setuptools said "invalid command 'bdist_wheel'".
"$python" -m venv "$tmp/plain" >"$tmp/venv.log" 2>&1 || fail "python -m venv" "$tmp/venv.log"
if "$tmp/plain/bin/python" -c 'import setuptools.command.bdist_wheel' 2>/dev/null ||
  "$tmp/plain/bin/python" -c 'import wheel' 2>/dev/null; then
  echo "skip a venv that cannot build wheels: this Python's venv can"
elif "$tmp/plain/bin/python" "${pip[@]:1}" "$tmp/src" >"$tmp/plain.log" 2>&1; then
  fail "an install with setuptools that cannot build wheels succeeded" "$tmp/plain.log"
elif ! grep -q "cannot build a wheel" "$tmp/plain.log" ||
  ! grep -qF "pip install 'setuptools>=70.1'" "$tmp/plain.log"; then
  fail "a venv that cannot build wheels is not told what to install" "$tmp/plain.log"
else
  echo "ok   a venv whose setuptools cannot build wheels is told to install setuptools>=70.1"
fi
echo "all pip install checks passed"
