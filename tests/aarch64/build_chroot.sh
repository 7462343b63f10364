#!/bin/sh
# `make aarch64`: an arm64 Debian chroot in .aarch64/ where tests/test_aarch64.py runs kernel tests under
# qemu-user, i.e. the NEON path of dllama/kernels/simd.py that the workers take on a Raspberry Pi.
#
# Built once (stamp files); a re-run only makes sure qemu-aarch64 is registered with binfmt_misc, which
# does not survive a reboot or a new container. Where it cannot be built it says why in one line, leaves
# that line in .aarch64/SKIPPED (the test's skip reason) and exits 0, so `make test` goes on.
set -eu

cd "$(dirname "$0")/../.."
DIR=$(pwd)/.aarch64
ROOTFS=$DIR/rootfs
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

skip() {
    echo "make aarch64: not built: $*"
    { mkdir -p "$DIR" && echo "$*" > "$DIR/SKIPPED"; } 2>/dev/null || true
    exit 0
}

[ "$(uname -s)" = Linux ] || skip "needs Linux (chroot, binfmt_misc)"
case $(uname -m) in
    aarch64|arm64) skip "this machine is aarch64 already: the suite itself runs the NEON path" ;;
esac
[ "$(id -u)" = 0 ] || skip "needs root (apt-get, mount, chroot)"

# --- host tools
need=""
command -v qemu-aarch64-static >/dev/null || need="$need qemu-user-static"
command -v update-binfmts >/dev/null || need="$need binfmt-support"
command -v debootstrap >/dev/null || need="$need debootstrap"
if [ -n "$need" ]; then
    command -v apt-get >/dev/null || skip "apt-get not found, cannot install$need"
    echo "make aarch64: apt-get install$need"
    export DEBIAN_FRONTEND=noninteractive
    # a fresh machine may have no package lists yet
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $need >/dev/null 2>&1 \
        || { apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null 2>&1 && apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $need >/dev/null; } \
        || skip "apt-get install$need failed"
fi

# --- qemu-aarch64 in binfmt_misc (every run: registrations are lost at reboot)
BINFMT=/proc/sys/fs/binfmt_misc
if [ ! -e $BINFMT/register ]; then
    mount -t binfmt_misc binfmt_misc $BINFMT 2>/dev/null || skip "cannot mount binfmt_misc at $BINFMT"
fi
if ! grep -qx enabled $BINFMT/qemu-aarch64 2>/dev/null; then
    update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
fi
if [ ! -e $BINFMT/qemu-aarch64 ]; then
    # Debian's entry, written directly (update-binfmts needs binfmt-support's database)
    magic='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
    mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
    printf '%s' ":qemu-aarch64:M::$magic:$mask:$(command -v qemu-aarch64-static):F" > $BINFMT/register 2>/dev/null || true
fi
grep -qx enabled $BINFMT/qemu-aarch64 2>/dev/null || skip "could not register qemu-aarch64 with binfmt_misc"
# F (fix binary): the kernel opened the interpreter at registration, so the chroot needs no copy of it
grep -q '^flags:.*F' $BINFMT/qemu-aarch64 || skip "qemu-aarch64 is registered without the F flag"

# --- the root file system: minbase + python3, unpacked on the host. debootstrap's first stage downloads
# and unpacks the base; its second stage would configure every package by running it under qemu (8 min
# on 2 cores, for nothing the tests need): the rest is unpacked with the host's dpkg-deb instead.
if [ ! -e "$DIR/.rootfs-built" ]; then
    rm -f "$DIR/SKIPPED"
    if [ -d "$ROOTFS" ]; then  # a build that was interrupted: start over
        grep -q " $ROOTFS/" /proc/mounts && skip "$ROOTFS has mounts left from an interrupted build (see /proc/mounts)"
        rm -rf "$ROOTFS"
    fi
    rm -f "$DIR"/.pip-*
    mkdir -p "$DIR"
    start=$(date +%s)
    echo "make aarch64: debootstrap --foreign --arch=arm64 bookworm into $ROOTFS (about a minute, once)"
    # in its own mount namespace, so that an interrupted run leaves nothing mounted in there
    unshare --mount --propagation private debootstrap --foreign --variant=minbase --arch=arm64 --include=python3 \
        bookworm "$ROOTFS" "$MIRROR" > "$DIR/debootstrap.log" 2>&1 \
        || skip "debootstrap failed, see $DIR/debootstrap.log"
    for deb in "$ROOTFS"/var/cache/apt/archives/*.deb; do
        dpkg-deb -x "$deb" "$ROOTFS" || skip "dpkg-deb -x $deb failed"
    done
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    [ -x "$ROOTFS/usr/bin/python3" ] || skip "no python3 in the unpacked root file system"
    touch "$DIR/.rootfs-built"
    echo "make aarch64: root file system in $(($(date +%s) - start)) s"
fi

# --- what the tests run inside need, in /opt/site (PYTHONPATH): the project's dependencies
# (pyproject.toml) and the test runner, not llama-cpp-python (tests that need it are skipped inside).
# aarch64 wheels, fetched by the host's pip (running pip under emulation took minutes); re-installed
# when that list changes.
PY=${PYTHON:-python3}
pyver=$(readlink "$ROOTFS/usr/bin/python3" | sed -n 's/^python\([0-9]*\.[0-9]*\)$/\1/p')
[ -n "$pyver" ] || skip "cannot tell the chroot's Python version from $ROOTFS/usr/bin/python3"
reqs=$("$PY" -c '
import re, sys, tomllib
project = tomllib.load(sys.stdin.buffer)["project"]
runner = [r for r in project["optional-dependencies"]["test"]
          if re.split(r"[\s<>=!~;\[]", r)[0] in ("pytest", "pytest-asyncio", "hypothesis")]
print("\n".join(project["dependencies"] + runner))' < pyproject.toml) || skip "cannot read pyproject.toml with $PY (3.11+)"
key=$(printf '%s %s' "$pyver" "$reqs" | cksum | cut -d' ' -f1)
if [ ! -e "$DIR/.pip-$key" ]; then
    rm -f "$DIR/SKIPPED"
    start=$(date +%s)
    echo "make aarch64: pip install for aarch64 (Python $pyver):" $reqs
    rm -rf "$ROOTFS/opt/site"
    printf '%s\n' "$reqs" > "$DIR/requirements.txt"
    # wheels only (building numpy or llvmlite under emulation would take hours), for bookworm's glibc (2.36)
    platforms=""
    for tag in manylinux2014_aarch64 manylinux_2_17_aarch64 manylinux_2_24_aarch64 manylinux_2_27_aarch64 \
               manylinux_2_28_aarch64 manylinux_2_31_aarch64 manylinux_2_34_aarch64 manylinux_2_35_aarch64; do
        platforms="$platforms --platform $tag"
    done
    "$PY" -m pip install --quiet --no-cache-dir --disable-pip-version-check --only-binary :all: $platforms \
        --implementation cp --python-version "$pyver" --target "$ROOTFS/opt/site" -r "$DIR/requirements.txt" \
        > "$DIR/pip.log" 2>&1 || skip "pip install for aarch64 failed, see $DIR/pip.log"
    rm -f "$DIR"/.pip-*
    touch "$DIR/.pip-$key"
    echo "make aarch64: pip install in $(($(date +%s) - start)) s"
fi
rm -f "$DIR/SKIPPED"
