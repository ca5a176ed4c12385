#!/usr/bin/env bash
# Builds a guest kernel for Firecracker from Debian's linux-source: an uncompressed vmlinux with
# virtio-mmio command-line devices, virtio block/net/balloon/vsock/rng and ext4 built in, so it
# boots the tools disk directly (no initramfs): root=/dev/vda ro init=/init/disk-init.
# Not run in CI: it takes ~8 min on 2 cores and ~3 GB of disk. Needs apt (installs build deps).
#   guest/kernel/build-firecracker-kernel.sh [--jobs N]
# Prints the vmlinux path.
source "$(dirname "$0")/../lib.sh"

JOBS=$(nproc)
[ "${1:-}" = --jobs ] && JOBS="$2"
OUT="$CACHE/kernel-firecracker"
mkdir -p "$OUT"

# The only host installs of the guest build: a compiler toolchain and the source package.
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends linux-source-6.1 build-essential flex bison bc libelf-dev libssl-dev xz-utils >/dev/null

src_tar=$(ls /usr/src/linux-source-6.1*.tar.xz | head -1)
ver=$(basename "$src_tar" .tar.xz)
VMLINUX="$OUT/vmlinux-$ver-firecracker"
if [ -s "$VMLINUX" ]; then echo "$VMLINUX"; exit 0; fi

build="$OUT/$ver"
[ -d "$build" ] || tar -C "$OUT" -xf "$src_tar"
cd "$build"
make -s defconfig
make -s kvm_guest.config
# y: what Firecracker's devices and our guest need; n: hardware and debugging a microVM never has.
scripts/config \
  -e VIRTIO -e VIRTIO_MMIO -e VIRTIO_MMIO_CMDLINE_DEVICES -e VIRTIO_BLK -e VIRTIO_NET \
  -e VIRTIO_BALLOON -e PAGE_REPORTING -e MEMORY_BALLOON -e VIRTIO_CONSOLE -e HW_RANDOM_VIRTIO \
  -e VSOCKETS -e VIRTIO_VSOCKETS -e ACPI -e PCI -e PVH -e KVM_GUEST -e PARAVIRT -e PARAVIRT_SPINLOCKS \
  -e SERIAL_8250 -e SERIAL_8250_CONSOLE -e SERIO_I8042 -e KEYBOARD_ATKBD \
  -e EXT4_FS -e TMPFS -e TMPFS_POSIX_ACL -e OVERLAY_FS -e SQUASHFS -e EROFS_FS -e FUSE_FS \
  -e DEVTMPFS -e DEVTMPFS_MOUNT -e BLK_DEV_INITRD -e CGROUPS -e MEMCG -e NAMESPACES -e USER_NS \
  -e IO_URING -e FHANDLE -e CRYPTO_MANAGER_DISABLE_TESTS -e RANDOM_TRUST_CPU -e MSDOS_PARTITION \
  -e DAMON -e DAMON_PADDR -e DAMON_RECLAIM \
  -d MODULES -d DRM -d FB -d SOUND -d USB_SUPPORT -d WIRELESS -d WLAN -d CFG80211 -d AUDIT \
  -d SECURITY_SELINUX -d FTRACE -d KPROBES -d PROFILING -d HIBERNATION -d SUSPEND -d EFI \
  -d NETFILTER -d MICROCODE -d DEBUG_INFO -d DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT -d HID \
  -d ETHERNET -d PCCARD -d ATA -d SCSI -d MD -d MACINTOSH_DRIVERS -d LOGO -d RANDOMIZE_BASE \
  -d KEXEC -d CRASH_DUMP -d DEBUG_WX \
  --set-val NR_CPUS 32
make -s olddefconfig
# Fail loudly if olddefconfig dropped something Firecracker cannot boot without.
for opt in VIRTIO_MMIO VIRTIO_MMIO_CMDLINE_DEVICES VIRTIO_BLK VIRTIO_NET EXT4_FS PVH KVM_GUEST; do
  grep -q "^CONFIG_$opt=y" .config || { log "CONFIG_$opt did not stick"; exit 1; }
done
make -s -j"$JOBS" vmlinux
cp vmlinux "$VMLINUX"
cp .config "$VMLINUX.config"
echo "$VMLINUX"
