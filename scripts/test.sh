#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh Debian machine (Debian's
# headless `chromium`, which the dashboard tests drive, `openssl` for the TLS tests, `slurm-wlm`
# and `munge` for the Slurm tests, `iproute2` for the slow-link test, `libopenblas0-pthread` for the CPU matmul that the kernel tests
# check against Flex's), then runs every test of the workspace (arguments go to
# `cargo test --workspace`, e.g. `-- slurm`) and ends with the list of tests skipped and why.
#
# One rule for the tests (actors/src/prerequisite.rs): under CI (`CI=true` or `CI=1`) nothing
# skips — a missing prerequisite fails its test, and a package that cannot be installed fails
# this script. Elsewhere, as root or with passwordless sudo the packages are installed; without,
# the script names them and the command, goes on, and the tests that need them are skipped.
# `.ci/run` calls this same script after fmt, clippy and doc.
set -euo pipefail
cd "$(dirname "$0")/.."

under_ci() { [ "${CI:-}" = true ] || [ "${CI:-}" = 1 ]; }

if [ "$(id -u)" = 0 ]; then
    sudo=""
elif command -v sudo > /dev/null && sudo -n true 2> /dev/null; then
    sudo="sudo -n"
else
    sudo="none"
fi
not_installed=()

# Whether Debian package $1 is installed (or, off Debian, its command $2 is there).
present() {
    dpkg-query -W -f='${Status}' "$1" 2> /dev/null | grep -q ' installed$' \
        || { [ -n "${2:-}" ] && PATH="$PATH:/usr/sbin:/sbin" command -v "$2" > /dev/null; }
}

# `need WHAT-FOR PACKAGE...`: installs the packages, or says why it cannot and notes them (under
# CI, where every test must run, that ends the script).
need() {
    local what_for=$1
    shift
    if [ "$sudo" != none ]; then
        echo "scripts/test.sh: installing Debian's $* $what_for" >&2
        if $sudo apt-get install -y -q "$@" > /dev/null 2>&1 \
            || { $sudo apt-get update -q > /dev/null && $sudo apt-get install -y -q "$@" > /dev/null; }; then
            return
        fi
        echo "scripts/test.sh: apt-get could not install $*" >&2
        under_ci && exit 1
    elif under_ci; then
        echo "scripts/test.sh: under CI the tests need Debian's $* ($what_for), but this user is" \
            "neither root nor has passwordless sudo: run as root, or install them first" >&2
        exit 1
    else
        echo "scripts/test.sh: not root and no passwordless sudo: Debian's $* ($what_for) not" \
            "installed; the tests that need them will be skipped" >&2
    fi
    not_installed+=("$@")
}

present chromium chromium || need "for the dashboard tests" chromium
present openssl openssl || need "for the TLS tests" openssl
{ present slurm-wlm slurmctld && present munge munged; } || need "for the Slurm tests" slurm-wlm munge
present iproute2 tc || need "for the slow-link test (ip, tc)" iproute2
present libopenblas0-pthread || need "for the CPU matmul the kernel tests check" libopenblas0-pthread
if command -v chromium > /dev/null; then chromium --version || true; fi

# Every skipped test appends its line here (ARCHIPELAGO_SKIP_LOG, actors/src/prerequisite.rs).
skip_log=$(mktemp "${TMPDIR:-/tmp}/archipelago-skipped.XXXXXX")
trap 'rm -f "$skip_log"' EXIT
status=0
# Strict registration mode (ARCHIPELAGO_STRICT_REGISTRY, actors/src/runtime/system.rs): every spawn
# and message that would cross a process is checked against the registry and encoded, also in one
# process, so a missing `.actor`/`.handles`/`.compiled` line fails here, in the tests, and not on
# a user's first cluster run. Deliberately local-only programs and tests turn it off on their runtime.
# --no-fail-fast: every test binary runs, so one failure does not hide the others.
ARCHIPELAGO_STRICT_REGISTRY=1 ARCHIPELAGO_SKIP_LOG="$skip_log" cargo test --workspace --no-fail-fast "$@" || status=$?

echo
if [ -s "$skip_log" ]; then
    echo "scripts/test.sh: $(wc -l < "$skip_log") test(s) skipped:"
    sort "$skip_log" | sed 's/^/  /'
else
    echo "scripts/test.sh: no test skipped"
fi
if [ ${#not_installed[@]} -gt 0 ]; then
    echo "scripts/test.sh: to run them, install: sudo apt-get install ${not_installed[*]}"
fi
exit "$status"
