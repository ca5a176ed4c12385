#!/usr/bin/env bash
# Gets Debian's stock cloud kernel without installing it on the host, extracts an uncompressed PVH
# vmlinux from it (QEMU boots that without decompressing) and builds a small initramfs holding
# busybox and the virtio modules, whose /init hands over to the tools disk.
#   guest/kernel/fetch-debian-kernel.sh [--force]
# Prints three lines: vmlinux path, initramfs path, vmlinuz path.
source "$(dirname "$0")/../lib.sh"

FORCE=0; [ "${1:-}" = --force ] && FORCE=1
OUT="$CACHE/kernel"
mkdir -p "$OUT"

# linux-image-cloud-amd64 is a metapackage; the versioned image package it depends on holds the files.
image_pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
if [ -z "$image_pkg" ]; then
  apt-get update -qq >/dev/null
  image_pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
fi
[ -n "$image_pkg" ] || { log "cannot resolve linux-image-cloud-amd64"; exit 1; }
kver="${image_pkg#linux-image-}"

VMLINUX="$OUT/vmlinux-$kver"; VMLINUZ="$OUT/vmlinuz-$kver"; INITRD="$OUT/initramfs-$kver.cpio"
BUSYBOX=$(busybox_bin)

if [ $FORCE = 1 ] || [ ! -s "$VMLINUX" ] || [ ! -s "$VMLINUZ" ]; then
  pkgdir="$OUT/pkg-$kver"
  unpack_deb "$(fetch_deb "$image_pkg")" "$pkgdir"
  cp "$pkgdir/boot/vmlinuz-$kver" "$VMLINUZ"
  # The bzImage payload is an LZ4 legacy frame (CONFIG_KERNEL_LZ4); its magic marks where it starts.
  off=$(grep -obUaP '\x02\x21\x4c\x18' "$VMLINUZ" | head -1 | cut -d: -f1)
  [ -n "$off" ] || { log "no LZ4 payload in $VMLINUZ (compression changed?)"; exit 1; }
  # lz4 stops with an error at the bzImage trailer that follows the frame; the ELF before it is whole.
  tail -c +$((off + 1)) "$VMLINUZ" | lz4 -dc >"$VMLINUX.tmp" 2>/dev/null || true
  [ "$(head -c 4 "$VMLINUX.tmp" | od -An -tx1 | tr -d ' ')" = 7f454c46 ] || { log "extracted vmlinux is not an ELF"; exit 1; }
  mv "$VMLINUX.tmp" "$VMLINUX"
fi

if [ $FORCE = 1 ] || stale "$INITRD" "$GUEST_DIR/init/initramfs-init" "$BUSYBOX" "$0"; then
  pkgdir="$OUT/pkg-$kver"
  [ -d "$pkgdir/lib/modules/$kver" ] || unpack_deb "$(fetch_deb "$image_pkg")" "$pkgdir"
  # depmod into a scratch copy of the module tree, so modprobe can list dependencies in load order.
  moddir=$(mktemp -d "$OUT/mods.XXXXXX")
  tree=$(mktemp -d "$OUT/initramfs.XXXXXX")
  trap 'rm -rf "$moddir" "$tree"' EXIT
  mkdir -p "$moddir/lib/modules"
  cp -a "$pkgdir/lib/modules/$kver" "$moddir/lib/modules/"
  depmod -b "$moddir" "$kver"
  mkdir -p "$tree"/{bin,dev,proc,sys,etc,lib/modules,tools,newroot}
  install -m 0755 "$BUSYBOX" "$tree/bin/busybox"
  install -m 0755 "$GUEST_DIR/init/initramfs-init" "$tree/init"
  : >"$tree/etc/aenv-modules"
  # Block, net and transport first; balloon and rng are optional devices but cheap to carry.
  for m in virtio_mmio virtio_blk virtio_net virtio_balloon virtio_rng; do
    modprobe -d "$moddir" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" {print $2}'
  done | awk '!seen[$0]++' | while read -r ko; do
    base=$(basename "$ko")
    cp "$ko" "$tree/lib/modules/$base"
    echo "$base" >>"$tree/etc/aenv-modules"
  done
  # /dev/console must exist before devtmpfs is mounted, or /init starts without stdio.
  (cd "$tree" && mknod -m 600 dev/console c 5 1 2>/dev/null || true)
  # Uncompressed: unpacking is faster than decompressing under TCG, and it is only a few MiB.
  (cd "$tree" && find . | sort | cpio -o -H newc --quiet --owner=0:0) >"$INITRD.tmp"
  mv "$INITRD.tmp" "$INITRD"
  log "initramfs: $INITRD ($(tr '\n' ' ' <"$tree/etc/aenv-modules"))"
fi

echo "$VMLINUX"
echo "$INITRD"
echo "$VMLINUZ"
