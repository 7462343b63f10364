#!/bin/sh
# `make browser`: Debian's chromium, which tests/test_chat_page.py drives through Playwright's Python
# package (Playwright never downloads a browser of its own here). About 120 MB, ~20 s on a fast mirror.
# Where it cannot be installed it says why in one line and exits 0: the test then skips, saying why.
set -u

skip() {
    echo "make browser: chromium not installed: $*"
    exit 0
}

command -v chromium >/dev/null 2>&1 && exit 0
[ "$(id -u)" = 0 ] || skip "needs root for apt-get (as root: apt-get install --no-install-recommends chromium)"
command -v apt-get >/dev/null 2>&1 || skip "apt-get not found (not Debian?)"
echo "make browser: apt-get install chromium"
export DEBIAN_FRONTEND=noninteractive
# make test runs this beside other jobs that may be using apt: wait for the lock instead of failing
install="apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium"
# a fresh machine may have no package lists yet
$install >/dev/null 2>&1 \
    || { apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null 2>&1 && $install >/dev/null; } \
    || skip "apt-get install chromium failed"
command -v chromium >/dev/null 2>&1 || skip "installed, but no chromium command on PATH"
