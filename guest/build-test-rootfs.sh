#!/usr/bin/env bash
# Builds a small busybox-based root filesystem image (raw ext4): a stand-in for a user's OCI image
# in tests and benchmarks. It holds nothing of ours; the tools disk brings init and envd.
#   guest/build-test-rootfs.sh [--out FILE] [--size MiB]
# Prints the image path.
source "$(dirname "$0")/lib.sh"

OUT="$CACHE/test-rootfs.ext4"; SIZE=64
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --size) SIZE="$2"; shift 2 ;;
    *) echo "usage: $0 [--out FILE] [--size MiB]" >&2; exit 2 ;;
  esac
done

BUSYBOX=$(busybox_bin)
if ! stale "$OUT" "$BUSYBOX" "$0"; then echo "$OUT"; exit 0; fi

tree=$(mktemp -d "$CACHE/rootfs-tree.XXXXXX")
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree"/{bin,sbin,etc,root,tmp,var/tmp,usr/bin,usr/sbin,home,proc,sys,dev,run}
chmod 1777 "$tree/tmp" "$tree/var/tmp"
install -m 0755 "$BUSYBOX" "$tree/bin/busybox"
for applet in $("$BUSYBOX" --list); do
  [ "$applet" = busybox ] || ln -s busybox "$tree/bin/$applet"
done
printf 'root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n' >"$tree/etc/passwd"
# user is in wheel too: envd must give processes their supplementary groups (tests check id -G).
printf 'root:x:0:\nwheel:x:10:root,user\nuser:x:1000:\n' >"$tree/etc/group"
mkdir -p "$tree/home/user" && chown 1000:1000 "$tree/home/user"
# The e2b SDK runs every command as `/bin/bash -l -c …` (and a PTY as `/bin/bash -i -l`); busybox
# has no bash applet, so this image's bash is ash under that name, as a slim user image might ship.
printf '#!/bin/sh\nexec /bin/busybox sh "$@"\n' >"$tree/bin/bash"
chmod 0755 "$tree/bin/bash"
echo "aenv-test-rootfs" >"$tree/etc/hostname"
# A test service of the image's own: busybox httpd (started by init with aenv.httpd_root=/srv/www)
# runs this CGI, which executes the POST body with sh. Tests drive the guest through it.
mkdir -p "$tree/srv/www/cgi-bin"
echo ok >"$tree/srv/www/health"
cat >"$tree/srv/www/cgi-bin/sh" <<'CGI'
#!/bin/sh
printf 'Content-Type: text/plain\r\n\r\n'
exec sh -c "$(cat)" 2>&1
CGI
chmod 0755 "$tree/srv/www/cgi-bin/sh"

rm -f "$OUT.tmp"
mkfs.ext4 -q -F -L rootfs -d "$tree" "$OUT.tmp" "${SIZE}M" >&2
mv "$OUT.tmp" "$OUT"
echo "$OUT"
