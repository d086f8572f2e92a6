# shellcheck shell=bash disable=SC2034  # the variables are for the scripts that source it
# Sourced by the tests/cli scripts, after `set -uo pipefail`:
#
#   source "$(dirname "$0")/lib.sh" NAME PATH_TO_TIDAL
#
# sets tidal (the binary), tmp (a scratch directory /var/tmp/tidal-NAME-*, removed at exit),
# failures (0) and py (a Python 3, for reading the CLI's JSON).
tidal=$2
tmp=$(mktemp -d "/var/tmp/tidal-$1-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0
py=$(command -v /usr/bin/python3 || command -v python3)

# finish WHAT: the script's last word: "N failure(s)" and exit status 1, or "all WHAT checks
# passed".
finish() {
  if ((failures > 0)); then
    echo "$failures failure(s)"
    exit 1
  fi
  echo "all $1 checks passed"
}
