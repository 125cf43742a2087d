#!/bin/bash
# Stage 2 of the soft-RoCE guest (see run.sh). Runs as root inside the QEMU
# guest, chrooted into the host's root filesystem (shared read-only over 9p).
# run.sh copies this file into the results share, which the guest mounts at
# /run/softroce; run.sh left there:
#   cwd   the host directory run.sh was started from
#   argv  the command to run, NUL-separated (no shell quoting involved)
#   env   NAME=VALUE pairs to export, NUL-separated
# This script sets up rxe0, runs the command and writes its exit status to
# /run/softroce/status. On a setup failure it writes the reason to
# /run/softroce/error instead and exits non-zero (run.sh then reports 124).
set -uo pipefail

RES=/run/softroce
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

die() {
    echo "softroce-guest: $*" >&2
    printf '%s\n' "$*" >"$RES/error"
    exit 1
}

# Quiet the console: only kernel emergencies may interleave with CMD's output.
dmesg -n 1 2>/dev/null || true

# --- RDMA setup (ARCHITECTURE.md § Soft-RoCE guest) ---------------------------
# crc32_generic must be loaded by hand, or `rdma link add` fails with ENOENT
# (rxe asks the crypto API for "crc32" and nothing autoloads it).
for mod in rdma_rxe ib_uverbs rdma_ucm dummy crc32_generic; do
    modprobe "$mod" || die "modprobe $mod failed"
done
ip link set lo up || die "ip link set lo up failed"
ip link add dummy0 type dummy &&
    ip addr add 10.99.0.1/24 dev dummy0 &&
    ip link set dummy0 up || die "setting up dummy0 (10.99.0.1/24) failed"
rdma link add rxe0 type rxe netdev dummy0 || die "rdma link add rxe0 failed"

# The port turns ACTIVE and the GID table fills asynchronously after
# `rdma link add`; wait for both (a few seconds at most, even under TCG).
# `read` instead of `cat`: no fork per file, the table has 1024 entries.
port=/sys/class/infiniband/rxe0/ports/1
gid_index=
for _ in $(seq 100); do
    state=
    read -r state 2>/dev/null <"$port/state"
    if [[ $state == *ACTIVE* ]]; then
        for ((i = 0; ; i++)); do
            [[ -e $port/gid_attrs/types/$i ]] || break
            # Unused entries fail to read (EINVAL).
            read -r type 2>/dev/null <"$port/gid_attrs/types/$i" || continue
            [[ $type == "RoCE v2" ]] || continue
            # IPv4-mapped GID, as sysfs prints it: 0000:...:0000:ffff:0a63:0001
            read -r gid 2>/dev/null <"$port/gids/$i" || continue
            [[ $gid == 0000:0000:0000:0000:0000:ffff:* ]] || continue
            gid_index=$i
            break
        done
    fi
    [[ -n $gid_index ]] && break
    sleep 0.1
done
[[ -n $gid_index ]] || die "rxe0 port 1 never became ACTIVE with a RoCE v2 IPv4 GID (state: ${state:-unknown})"

# --- the command ------------------------------------------------------------
# Host environment chosen by run.sh (PATH, HOME, TERM, LANG).
while IFS= read -r -d '' kv; do
    export "$kv"
done <"$RES/env"
export OFL_TEST_RDMA_DEVICE=rxe0
export OFL_TEST_RDMA_GID_INDEX=$gid_index
export OFL_TEST_RDMA_ADDR=10.99.0.1
# The root is read-only: no __pycache__ writes, caches go to tmpfs.
export PYTHONDONTWRITEBYTECODE=1
export XDG_CACHE_HOME=/tmp/.cache
# Root has CAP_IPC_LOCK anyway; this also covers CMD dropping privileges.
ulimit -l unlimited

mapfile -d '' -t argv <"$RES/argv"
cwd=$(<"$RES/cwd")
cd -- "$cwd" || die "cannot cd to $cwd inside the guest"

# stdin from /dev/null: the console has no input, a read would hang forever.
"${argv[@]}" </dev/null
rc=$?
# Write then rename, so run.sh never sees a half-written status.
echo "$rc" >"$RES/status.tmp" && mv "$RES/status.tmp" "$RES/status"
exit 0
