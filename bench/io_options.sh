# shellcheck shell=bash disable=SC2034  # the variables are the sourcing script's
# Shared by the benchmarks that compare tidal's store with a peer on one directory
# (bench/io_vs_fio.sh, bench/vs_deepspeed.sh): source it before reading the options.
#
# io_option ARGS...: when "$1" is one of the options they share (--rounds N, --pause S,
# --block B, --depth Q, --no-checksum), sets its variable (rounds, pause, block_text, depth,
# checksum_flag) and taken to the number of words it used; else taken=0. An option missing its
# value calls the script's usage.
io_option() {
  taken=2
  case "$1" in
    --rounds) [ $# -ge 2 ] || usage; rounds="$2" ;;
    --pause) [ $# -ge 2 ] || usage; pause="$2" ;;
    --block) [ $# -ge 2 ] || usage; block_text="$2" ;;
    --depth) [ $# -ge 2 ] || usage; depth="$2" ;;
    --no-checksum) checksum_flag="--no-checksum"; taken=1 ;;
    *) taken=0 ;;
  esac
}
