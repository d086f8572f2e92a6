#!/usr/bin/env bash
# The Debian libraries tidal's build needs, unpacked into a folder that travels to a GPU machine
# without network (bench/gpu.sh uses it: TIDAL_GPU_DEPS, default .gpudeps where it exists).
#
#   bench/gpu_deps.sh [DIR]     # here, on a Debian machine that reaches Debian's archive
#
# DIR (default .gpudeps in the repository root) gets root/: the packages below unpacked with
# `dpkg -x` (nothing is installed on this machine or that one), their pkg-config files made
# relocatable (prefix=${pcfiledir}/...), and env.sh, which puts them on CMAKE_PREFIX_PATH,
# PKG_CONFIG_PATH and LD_LIBRARY_PATH (and pkgconf on PATH where the machine has no pkg-config).
# Libraries from Debian 12 need glibc 2.36 or newer on the GPU machine.
# Add DIR to .git/info/exclude; a device call carries it (about 5 MiB).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/.gpudeps}
packages=(liburing-dev liburing2 libxxhash-dev libxxhash0 nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev pkgconf-bin libpkgconf3)
command -v apt-get >/dev/null || { echo "bench/gpu_deps.sh: needs apt-get (a Debian machine)" >&2; exit 1; }
rm -rf "$dir/debs" "$dir/root"
mkdir -p "$dir/debs" "$dir/root"
(cd "$dir/debs" && apt-get download "${packages[@]}") ||
  { echo "bench/gpu_deps.sh: apt-get download failed (no network, or run apt-get update first)" >&2; exit 1; }
for deb in "$dir"/debs/*.deb; do dpkg -x "$deb" "$dir/root"; done
rm -rf "$dir/debs" "$dir/root/usr/share/doc" "$dir/root/usr/share/man"
# pkg-config files: prefix relative to the file, so the folder can sit anywhere.
while IFS= read -r pc; do
  rel=$(realpath --relative-to="$(dirname "$pc")" "$dir/root/usr")
  sed -i -e "s|^prefix=.*|prefix=\${pcfiledir}/$rel|" -e 's|=/usr/|=${prefix}/|' "$pc"
done < <(find "$dir/root" -name '*.pc')
cat >"$dir/env.sh" <<'SH'
# source DIR/env.sh: the unpacked libraries on the build's and the loader's search paths.
_deps=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/root/usr
_arch=$_deps/lib/x86_64-linux-gnu
export CMAKE_PREFIX_PATH=$_deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
export PKG_CONFIG_PATH=$_arch/pkgconfig:$_deps/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export LD_LIBRARY_PATH=$_arch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ! command -v pkg-config >/dev/null; then
  mkdir -p "$_deps/../bin-pc" && ln -sf "$_deps/bin/pkgconf" "$_deps/../bin-pc/pkg-config"
  export PATH=$_deps/../bin-pc:$PATH
fi
unset _deps _arch
SH
echo "bench/gpu_deps.sh: $(du -sh "$dir" | cut -f1) in $dir (${packages[*]})"
