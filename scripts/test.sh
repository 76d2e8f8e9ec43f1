#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh Debian machine (Debian's
# headless `chromium`, which the dashboard test drives, `openssl` for the TLS tests, `slurm-wlm`
# and `munge` for the Slurm tests, `libopenblas0-pthread` for the CPU matmul that the kernel tests
# check against Flex's), then runs every test of the workspace.
# `.ci/run` calls this same script after fmt, clippy and doc.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium > /dev/null; then
    echo "scripts/test.sh: installing Debian's chromium for the dashboard test" >&2
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    $sudo apt-get install -y -q chromium > /dev/null 2>&1 \
        || { $sudo apt-get update -q > /dev/null && $sudo apt-get install -y -q chromium > /dev/null; }
fi
if ! command -v openssl > /dev/null; then
    # The TLS tests check that certificates made by openssl work like `archipelago certs`' own.
    echo "scripts/test.sh: installing Debian's openssl for the TLS tests" >&2
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    $sudo apt-get install -y -q openssl > /dev/null 2>&1 \
        || { $sudo apt-get update -q > /dev/null && $sudo apt-get install -y -q openssl > /dev/null; }
fi
if ! command -v slurmctld > /dev/null || ! command -v munged > /dev/null; then
    # The Slurm tests bring up a single-node Slurm (controller/tests/slurm.rs); under CI they
    # must run, so the packages are installed here, never assumed.
    echo "scripts/test.sh: installing Debian's slurm-wlm and munge for the Slurm tests" >&2
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    $sudo apt-get install -y -q slurm-wlm munge > /dev/null 2>&1 \
        || { $sudo apt-get update -q > /dev/null && $sudo apt-get install -y -q slurm-wlm munge > /dev/null; }
fi
if ! dpkg -s libopenblas0-pthread > /dev/null 2>&1; then
    # The CPU matmul (actors/src/kernels) loads OpenBLAS at run time; under CI its tests require it.
    echo "scripts/test.sh: installing Debian's libopenblas0-pthread for the CPU matmul" >&2
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    $sudo apt-get install -y -q libopenblas0-pthread > /dev/null 2>&1 \
        || { $sudo apt-get update -q > /dev/null && $sudo apt-get install -y -q libopenblas0-pthread > /dev/null; }
fi
chromium --version
cargo test --workspace "$@"
