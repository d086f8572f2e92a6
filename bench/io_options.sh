# shellcheck shell=bash disable=SC2034  # the variables are the sourcing script's
# Shared by the benchmarks that compare tidal's store with a peer on one directory
# (bench/io_vs_fio.sh, bench/vs_deepspeed.sh): source it for the options they share, with their
# defaults: --rounds N (rounds=4), --pause S (pause=5), --block B (block_text=1MiB), --depth Q
# (depth=16), --no-checksum (checksum_flag) and --json FILE (json_out).
rounds=4
pause=5
block_text=1MiB
depth=16
checksum_flag=""
json_out=""

# io_option ARGS...: when "$1" is one of the shared options, sets its variable and taken to the
# number of words it used; else taken=0. An option missing its value calls the script's usage.
io_option() {
  taken=2
  case "$1" in
    --rounds) [ $# -ge 2 ] || usage; rounds="$2" ;;
    --pause) [ $# -ge 2 ] || usage; pause="$2" ;;
    --block) [ $# -ge 2 ] || usage; block_text="$2" ;;
    --depth) [ $# -ge 2 ] || usage; depth="$2" ;;
    --json) [ $# -ge 2 ] || usage; json_out="$2" ;;
    --no-checksum) checksum_flag="--no-checksum"; taken=1 ;;
    *) taken=0 ;;
  esac
}

# read_options ARGS...: the shared options, then the script's own through its own_option (which
# sets taken as io_option does); -h, --help and an unknown option call usage; the other words go
# to args.
read_options() {
  args=()
  while [ $# -gt 0 ]; do
    io_option "$@"
    [ "$taken" -gt 0 ] || own_option "$@"
    if [ "$taken" -gt 0 ]; then
      shift "$taken"
      continue
    fi
    case "$1" in
      -h|--help) usage ;;
      -*) echo "unknown option: $1" >&2; usage ;;
      *) args+=("$1") ;;
    esac
    shift
  done
}
