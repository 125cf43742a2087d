#!/bin/bash
# Run a command inside a QEMU guest (software emulation, Debian's stock
# kernel) that has a real RDMA verbs device: soft-RoCE rxe0 over dummy0.
# Background: ARCHITECTURE.md § Soft-RoCE guest
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: tools/softroce/run.sh [--timeout SECONDS] -- CMD [ARGS...]

Boots Debian's stock kernel under QEMU (TCG) with the host's root filesystem
shared read-only, creates the soft-RoCE device rxe0 on dummy0 (10.99.0.1/24)
and runs CMD as root in the current directory. Writable inside the guest:
/tmp, /run, /dev/shm (tmpfs, discarded at exit). CMD's output appears here
(via the guest serial console); its stdin is /dev/null.

CMD sees:
  OFL_TEST_RDMA_DEVICE=rxe0
  OFL_TEST_RDMA_GID_INDEX=<RoCE v2 IPv4 GID index, usually 1>
  OFL_TEST_RDMA_ADDR=10.99.0.1
  PYTHONDONTWRITEBYTECODE=1, XDG_CACHE_HOME=/tmp/.cache
  PATH, HOME, TERM, LANG from this shell

Options:
  --timeout SECONDS  kill the guest after this long (default 300)
  -h, --help         show this help

Exit status: CMD's; 124 if the guest timed out, failed to set up rxe0 or
never reported a status; 2 for usage errors and missing prerequisites.
Needs (Debian): qemu-system-x86 linux-image-amd64 busybox-static kmod cpio
iproute2 ibverbs-providers (rdma-core).
EOF
}

die() {
    echo "softroce: $*" >&2
    exit 2
}

timeout_s=300
while (($#)); do
    case $1 in
    --timeout)
        (($# >= 2)) || die "--timeout needs a value"
        timeout_s=$2
        shift 2
        ;;
    --timeout=*) timeout_s=${1#*=}; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) usage >&2; die "unexpected argument '$1' (the command goes after --)" ;;
    esac
done
(($#)) || { usage >&2; die "no command given"; }
[[ $timeout_s =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive integer, got '$timeout_s'"

here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)

# --- prerequisites ----------------------------------------------------------
need_cmd() { # command package
    command -v "$1" >/dev/null || die "'$1' not found; install the Debian package $2"
}
need_cmd qemu-system-x86_64 qemu-system-x86
need_cmd cpio cpio
need_cmd gzip gzip
need_cmd timeout coreutils
# These run inside the guest, which uses this machine's root filesystem.
need_cmd modprobe kmod
need_cmd ip iproute2
need_cmd rdma iproute2

busybox=/bin/busybox
[[ -x $busybox ]] || die "$busybox not found; install the Debian package busybox-static"
# The initramfs has no libc, so busybox must be the static build.
if LC_ALL=C ldd "$busybox" 2>&1 | grep -q '=>'; then
    die "$busybox is dynamically linked; install the Debian package busybox-static"
fi

# Newest kernel that has both an image in /boot and the rdma_rxe module.
kver=
while read -r v; do
    if [[ -e /boot/vmlinuz-$v ]] &&
        [[ -n $(find "/lib/modules/$v/kernel/drivers/infiniband" -name 'rdma_rxe.ko*' -print -quit 2>/dev/null) ]]; then
        kver=$v
        break
    fi
done < <(ls -1 /lib/modules 2>/dev/null | sort -rV)
[[ -n $kver ]] || die "no kernel with /boot/vmlinuz-<version> and the rdma_rxe module; install the Debian package linux-image-amd64"
kernel=/boot/vmlinuz-$kver
moddir=/lib/modules/$kver
[[ -r $kernel ]] || die "$kernel is not readable (Debian makes it root-only: run as root)"

ls /usr/lib/*/libibverbs/librxe-rdmav*.so >/dev/null 2>&1 ||
    die "no rxe verbs provider (librxe-rdmav*.so); install the Debian package ibverbs-providers"

# The guest overmounts these with devtmpfs/proc/sysfs. (/tmp and /run get tmpfs too, but
# CMD's directory is shared on its own and mounted back at its path: CI may clone into /tmp.)
case $PWD/ in
/dev/* | /proc/* | /sys/* | /run/softroce/*)
    die "the current directory $PWD is hidden inside the guest; run from elsewhere" ;;
esac

# --- temp dir: initramfs tree, image and the results share --------------------
tmp=$(mktemp -d -t softroce.XXXXXX)
trap 'rm -rf -- "$tmp"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mkdir -p "$tmp"/root/{bin,dev,proc,sys,host,lib/modules} "$tmp/work"

# Stage 1 only needs virtio PCI and 9p to reach the host's root; everything
# else is loaded with the host's own modprobe after the chroot.
# Order matters: each module's dependencies come before it.
initmods="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci
netfs fscache 9pnet 9pnet_virtio 9p"
for m in $initmods; do
    f=$(find "$moddir/kernel" \( -name "$m.ko" -o -name "$m.ko.*" \) -print -quit)
    if [[ -z $f ]]; then
        # Built into this kernel: nothing to load.
        grep -q "/$m.ko\$" "$moddir/modules.builtin" 2>/dev/null && continue
        die "module $m not found under $moddir; reinstall the Debian package linux-image-$kver"
    fi
    # Busybox insmod takes plain .ko files only.
    case $f in
    *.ko) cp "$f" "$tmp/root/lib/modules/$m.ko" ;;
    *.ko.xz) need_cmd xz xz-utils; xz -dc "$f" >"$tmp/root/lib/modules/$m.ko" ;;
    *.ko.zst) need_cmd zstd zstd; zstd -qdc "$f" >"$tmp/root/lib/modules/$m.ko" ;;
    *.ko.gz) gzip -dc "$f" >"$tmp/root/lib/modules/$m.ko" ;;
    *) die "unknown module format: $f" ;;
    esac
    echo "$m" >>"$tmp/root/modules.order"
done
cp "$busybox" "$tmp/root/bin/busybox"

# Stage 1 /init (busybox sh): reach the host's root over 9p and chroot into it
# to run guest-init.sh. Any failure powers off without a status file.
cat >"$tmp/root/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() {
    echo "softroce-init: $*"
    poweroff -f
}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.order); do
    insmod "/lib/modules/$m.ko" || fail "insmod $m failed"
done
p9='trans=virtio,version=9p2000.L,msize=262144'
mount -t 9p -o "$p9,ro" hostroot /host || fail "cannot mount the host root (9p hostroot)"
mount -t proc proc /host/proc
mount -t sysfs sysfs /host/sys
mount -t devtmpfs devtmpfs /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm
mount -t tmpfs -o mode=1777 tmpfs /host/tmp
mount -t tmpfs -o mode=755 tmpfs /host/run
mkdir -p /host/run/softroce
mount -t 9p -o "$p9" work /host/run/softroce || fail "cannot mount the results share (9p work)"
# CMD's directory, shared on its own, at its own path (it may lie under the tmpfs above).
cwd=$(cat /host/run/softroce/cwd)
mkdir -p "/host$cwd" 2>/dev/null
mount -t 9p -o "$p9,ro" cwd "/host$cwd" || fail "cannot mount $cwd (9p cwd)"
# The serial line would turn \n into \r\n; the host terminal is not in raw
# mode (qemu's stdin is /dev/null), so plain \n is what it wants.
stty -onlcr 2>/dev/null
chroot /host /bin/bash /run/softroce/guest-init.sh
sync
umount "/host$cwd"
umount /host/run/softroce
# Console level 0 hides even the kernel's "reboot: Power down" line.
echo 0 >/proc/sys/kernel/printk
poweroff -f
EOF
chmod +x "$tmp/root/init"
(cd "$tmp/root" && find . | cpio -o -H newc --quiet | gzip -1 >"$tmp/initramfs.cpio.gz")

# What guest-init.sh reads from the results share (see its header).
cp "$here/guest-init.sh" "$tmp/work/guest-init.sh"
printf '%s' "$PWD" >"$tmp/work/cwd"
printf '%s\0' "$@" >"$tmp/work/argv"
# PATH as here (so CMD resolves the same tools), plus the sbin dirs for root.
guest_path=$PATH
for d in /usr/local/sbin /usr/sbin /sbin; do
    [[ :$guest_path: == *:$d:* ]] || guest_path=$guest_path:$d
done
printf '%s\0' "PATH=$guest_path" "HOME=${HOME:-/root}" "TERM=${TERM:-dumb}" \
    "LANG=${LANG:-C.UTF-8}" >"$tmp/work/env"

# --- boot ---------------------------------------------------------------------
# stdin </dev/null keeps qemu from putting the terminal into raw mode and
# makes Ctrl-C reach qemu as a plain SIGINT. --foreground keeps qemu in our
# process group for the same reason; -k kills it if SIGTERM is not enough.
# qboot instead of SeaBIOS: SeaBIOS writes banners and terminal escape codes
# (screen clear) to the serial console; qboot prints nothing and boots faster.
start=$SECONDS
set +e
timeout --foreground -k 10 "$timeout_s" \
    qemu-system-x86_64 -accel tcg,thread=multi -M pc -cpu max -smp 2 -m 3072 \
    -nographic -no-reboot -nic none -bios qboot.rom \
    -kernel "$kernel" -initrd "$tmp/initramfs.cpio.gz" \
    -append "console=ttyS0 rdinit=/init panic=-1 quiet loglevel=3" \
    -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
    -virtfs "local,path=$tmp/work,mount_tag=work,security_model=none,multidevs=remap" \
    -virtfs "local,path=$PWD,mount_tag=cwd,security_model=none,readonly=on,multidevs=remap" \
    </dev/null
qemu_rc=$?
set -e
elapsed=$((SECONDS - start))

if [[ -s $tmp/work/status ]]; then
    rc=$(<"$tmp/work/status")
    echo "softroce: guest exited with status $rc in $elapsed s"
    exit "$rc"
fi
if ((qemu_rc == 124 || qemu_rc == 137)); then
    echo "softroce: guest timed out after $timeout_s s (--timeout); no exit status" >&2
elif [[ -s $tmp/work/error ]]; then
    echo "softroce: guest setup failed after $elapsed s: $(<"$tmp/work/error")" >&2
else
    echo "softroce: guest never wrote an exit status (qemu exited with $qemu_rc after $elapsed s; see the console output above)" >&2
fi
exit 124
