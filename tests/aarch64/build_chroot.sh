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
VENV=/opt/venv  # inside the chroot: bookworm's pip refuses to install into the system python (PEP 668)

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

# Runs a command in the chroot with /proc mounted, in a private mount namespace (the mount goes away
# with the process, whatever happens), with a clean environment.
in_chroot() {
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
        ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} \
        ${HTTP_PROXY:+HTTP_PROXY=$HTTP_PROXY} ${HTTPS_PROXY:+HTTPS_PROXY=$HTTPS_PROXY} \
        ${no_proxy:+no_proxy=$no_proxy} ${NO_PROXY:+NO_PROXY=$NO_PROXY} ${PIP_INDEX_URL:+PIP_INDEX_URL=$PIP_INDEX_URL} \
        unshare --mount --propagation private \
        sh -c 'mount -t proc proc "$0/proc" && exec chroot "$0" "$@"' "$ROOTFS" "$@"
}

# --- the root file system: minbase + python3-venv
if [ ! -e "$DIR/.rootfs-built" ]; then
    rm -f "$DIR/SKIPPED"
    if [ -d "$ROOTFS" ]; then  # a build that was interrupted: start over
        grep -q " $ROOTFS/" /proc/mounts && skip "$ROOTFS has mounts left from an interrupted build (see /proc/mounts)"
        rm -rf "$ROOTFS"
    fi
    mkdir -p "$DIR"
    start=$(date +%s)
    echo "make aarch64: debootstrap --arch=arm64 bookworm into $ROOTFS (a few minutes, once)"
    # in its own mount namespace, so that an interrupted run leaves no /proc or /sys mounted in there
    unshare --mount --propagation private debootstrap --variant=minbase --arch=arm64 --include=python3-venv \
        bookworm "$ROOTFS" "$MIRROR" > "$DIR/debootstrap.log" 2>&1 \
        || skip "debootstrap failed, see $DIR/debootstrap.log"
    in_chroot /usr/bin/python3 -m venv $VENV || skip "python3 -m venv failed in the chroot"
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    touch "$DIR/.rootfs-built"
    echo "make aarch64: root file system in $(($(date +%s) - start)) s"
fi

# --- what the tests run inside need: the project's dependencies (pyproject.toml) and the test runner
# (not llama-cpp-python: tests that need it are skipped inside). Re-installed when that list changes.
reqs=$(in_chroot /usr/bin/python3 -c '
import re, sys, tomllib
project = tomllib.load(sys.stdin.buffer)["project"]
runner = [r for r in project["optional-dependencies"]["test"]
          if re.split(r"[\s<>=!~;\[]", r)[0] in ("pytest", "pytest-asyncio", "hypothesis")]
print("\n".join(project["dependencies"] + runner))' < pyproject.toml) || skip "cannot read pyproject.toml in the chroot"
key=$(printf '%s' "$reqs" | cksum | cut -d' ' -f1)
if [ ! -e "$DIR/.pip-$key" ]; then
    rm -f "$DIR/SKIPPED"
    start=$(date +%s)
    echo "make aarch64: pip install in the chroot:" $reqs
    printf '%s\n' "$reqs" > "$ROOTFS/tmp/requirements.txt"
    # the host's CA bundle, which knows whatever proxy stands between this machine and PyPI
    ca=${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}
    [ -f "$ca" ] || skip "no CA bundle for pip at $ca (set PIP_CERT)"
    cp "$ca" "$ROOTFS/tmp/host-ca.pem"
    # wheels only: building numpy or llvmlite under emulation would take hours
    in_chroot $VENV/bin/python -m pip install --quiet --no-cache-dir --disable-pip-version-check \
        --cert /tmp/host-ca.pem --only-binary :all: -r /tmp/requirements.txt > "$DIR/pip.log" 2>&1 \
        || skip "pip install in the chroot failed, see $DIR/pip.log"
    rm -f "$DIR"/.pip-*
    touch "$DIR/.pip-$key"
    echo "make aarch64: pip install in $(($(date +%s) - start)) s"
fi
rm -f "$DIR/SKIPPED"
