#!/usr/bin/env bash
# Builds the read-only tools disk (vda): busybox-static from Debian, our init stages, the root-only
# sudo for images without one (tools/sudo) and, when given, the envd binary. Every VM on a node
# shares this one image. A dynamically linked envd (a `bun build --compile` binary) is patched to
# load from /agentenv/lib, which gets its loader and libraries, so it runs on any user image, with
# or without a libc of its own.
#   guest/build-tools-disk.sh [--envd FILE] [--out FILE] [--force]
# Prints the image path. Rebuilt only when missing or older than its inputs.
source "$(dirname "$0")/lib.sh"

OUT="$CACHE/tools.img"; ENVD=""; FORCE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --envd) ENVD="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    *) echo "usage: $0 [--envd FILE] [--out FILE] [--force]" >&2; exit 2 ;;
  esac
done

BUSYBOX=$(busybox_bin)
inputs=("$GUEST_DIR/init" "$GUEST_DIR/tools" "$BUSYBOX" "$0")
[ -n "$ENVD" ] && inputs+=("$ENVD")
# The envd stamp makes switching envd on or off rebuild the image even when no file got newer.
stamp="envd=${ENVD:+$(stat -c '%s %Y' "$ENVD")}"
if [ $FORCE = 0 ] && ! stale "$OUT" "${inputs[@]}" && [ "$(cat "$OUT.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$OUT"; exit 0
fi

tree=$(mktemp -d "$CACHE/tools-tree.XXXXXX")
trap 'rm -rf "$tree"' EXIT
# Mount points used while the tools disk is the kernel's root (disk-init); it is never writable.
mkdir -p "$tree"/{bin,init,dev,proc,sys,newroot,tmp}
install -m 0755 "$BUSYBOX" "$tree/bin/busybox"
# Applet links, so /agentenv/bin can go on a user's PATH as a fallback toolbox.
for applet in $("$BUSYBOX" --list); do
  [ "$applet" = busybox ] || ln -s busybox "$tree/bin/$applet"
done
install -m 0755 "$GUEST_DIR/init/boot" "$GUEST_DIR/init/run" "$GUEST_DIR/init/disk-init" "$tree/init/"
# Last on envd's PATH, for images without a sudo of their own. Nothing on this disk is setuid.
install -m 0755 "$GUEST_DIR/tools/sudo" "$tree/bin/sudo"
# Install a program at $tree/$2; a dynamic ELF gets its libraries in $tree/lib and is patched to
# load from /agentenv/lib. A static binary or a script goes in as it is.
add_program() {
  local src="$1" dest="$tree/$2" is_elf=0 interp libs lib
  install -m 0755 "$src" "$dest"
  [ "$(head -c4 "$src" | od -An -c | tr -d ' \n')" = '177ELF' ] && is_elf=1
  if [ $is_elf = 1 ] && ! command -v patchelf >/dev/null; then
    echo "patchelf is needed to point $src at /agentenv/lib (apt-get install patchelf)" >&2; exit 1
  fi
  # Only a dynamic ELF has an interpreter.
  if [ $is_elf = 1 ] && interp=$(patchelf --print-interpreter "$dest" 2>/dev/null); then
    mkdir -p "$tree/lib"
    # ldd lists the resolved libraries ("name => /path") and the loader (a bare absolute path).
    libs=$(ldd "$src" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
    [ -n "$libs" ] || { echo "ldd found no libraries for $src" >&2; exit 1; }
    for lib in $libs; do cp -L "$lib" "$tree/lib/$(basename "$lib")"; done
    [ -e "$tree/lib/$(basename "$interp")" ] || { echo "loader $interp of $src not found by ldd" >&2; exit 1; }
    patchelf --set-interpreter "/agentenv/lib/$(basename "$interp")" --set-rpath /agentenv/lib "$dest"
  fi
}

if [ -n "$ENVD" ]; then
  add_program "$ENVD" envd
  # util-linux setpriv replaces busybox's applet of that name: envd starts processes through it to
  # give them their supplementary groups (busybox's cannot set ids at all).
  SETPRIV=$(command -v setpriv) || { echo "setpriv (util-linux) is needed for the tools disk" >&2; exit 1; }
  rm -f "$tree/bin/setpriv"
  add_program "$SETPRIV" bin/setpriv
fi

# Size: content plus a margin for ext4 metadata, in whole MiB.
kib=$(du -sk "$tree" | cut -f1)
mib=$(( (kib * 12 / 10) / 1024 + 8 ))
tmp_img="$OUT.tmp"
rm -f "$tmp_img"
# No journal: the image is mounted read-only everywhere and never replayed.
mkfs.ext4 -q -F -L agentenv-tools -O ^has_journal -E root_owner=0:0 -d "$tree" "$tmp_img" "${mib}M" >&2
mv "$tmp_img" "$OUT"
echo "$stamp" >"$OUT.stamp"
log "tools disk: $OUT (${mib} MiB${ENVD:+, envd from $ENVD})"
echo "$OUT"
