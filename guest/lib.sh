# Shared by the guest build scripts: where artifacts are cached and how Debian packages are fetched
# without installing them on the host.
set -euo pipefail

GUEST_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Built artifacts live here (gitignored); AENV_GUEST_CACHE moves them (the node sets its guest_cache).
CACHE="${AENV_GUEST_CACHE:-$GUEST_DIR/.cache}"
mkdir -p "$CACHE/debs"

log() { echo "guest: $*" >&2; }

# Download one Debian package into the cache (no install) and print the .deb path.
fetch_deb() {
  local pkg="$1" deb
  deb=$(ls "$CACHE/debs/${pkg}_"*.deb 2>/dev/null | head -1 || true)
  if [ -z "$deb" ]; then
    # apt drops privileges to _apt when it can; a root-owned temp dir keeps it quiet and working.
    local tmp; tmp=$(mktemp -d "$CACHE/debs/.dl.XXXXXX")
    (cd "$tmp" && apt-get download -q "$pkg" >/dev/null 2>&1) || {
      # An outdated package list is the usual reason a download fails on a fresh machine.
      apt-get update -qq >/dev/null && (cd "$tmp" && apt-get download -q "$pkg" >/dev/null)
    }
    mv "$tmp"/*.deb "$CACHE/debs/" && rmdir "$tmp"
    deb=$(ls "$CACHE/debs/${pkg}_"*.deb | head -1)
  fi
  echo "$deb"
}

# Unpack a .deb into DIR (fresh each time, so stale files never leak into an image).
unpack_deb() {
  rm -rf "$2" && mkdir -p "$2" && dpkg-deb -x "$1" "$2"
}

# busybox-static from Debian, unpacked once; prints the binary's path.
busybox_bin() {
  local dir="$CACHE/busybox"
  if [ ! -x "$dir/bin/busybox" ]; then
    unpack_deb "$(fetch_deb busybox-static)" "$dir"
  fi
  echo "$dir/bin/busybox"
}

# True when OUT is missing or older than any of the inputs.
stale() {
  local out="$1"; shift
  [ -e "$out" ] || return 0
  local f
  for f in "$@"; do
    if [ -d "$f" ]; then
      [ -z "$(find "$f" -newer "$out" -print -quit)" ] || return 0
    elif [ -e "$f" ] && [ "$f" -nt "$out" ]; then
      return 0
    fi
  done
  return 1
}
