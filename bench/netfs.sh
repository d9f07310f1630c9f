#!/usr/bin/env bash
# A network file system on one machine: sshfs over the loopback interface to a
# throwaway sshd, with a set round-trip delay, around one command.
#
#   bench/netfs.sh install
#       apt-get install openssh-server and sshfs when they are missing (root).
#   bench/netfs.sh run --export DIR --mount MNT --rtt-ms MS [--info FILE] -- COMMAND [ARG...]
#       Start sshd on a free port of 127.0.0.1 (its own config and keys, in a
#       temporary folder), mount DIR at MNT with sshfs through
#       bench/delay_proxy.py (ssh's ProxyCommand), which holds every chunk
#       MS/2 milliseconds in each direction, run COMMAND, return its status.
#       --info FILE writes the port, the round trip added and the measured
#       time of one file-system request (a stat of a name that does not
#       exist, which sshfs must ask the server about) as JSON.
#
# Why a proxy and not `tc qdisc add dev lo ... netem delay`: this machine's
# kernel has neither sch_netem nor sch_prio ("Specified qdisc kind is
# unknown"), and a delay on the whole of lo would also slow MPI, gloo and every
# other user's loopback traffic. The proxy delays this mount's traffic only,
# pipelined (latency, not bandwidth), and changes no interface.
#
# Every exit (the command's end, an error, Ctrl-C, SIGTERM, SIGHUP) stops the
# command, unmounts MNT, stops that sshd (by its PID) and removes the
# temporary folder. Needs root (sshd, FUSE), as CI has.
set -eu

die() { echo "netfs: error: $*" >&2; exit 2; }
say() { echo "netfs: $*" >&2; }

install_tools() {
    local missing=()
    command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
    command -v sshfs >/dev/null 2>&1 || missing+=(sshfs)
    if [ ${#missing[@]} -eq 0 ]; then say "sshd and sshfs are installed"; return 0; fi
    [ "$(id -u)" -eq 0 ] || die "installing ${missing[*]} needs root"
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

[ $# -ge 1 ] || die "usage: $0 install | run --export DIR --mount MNT --rtt-ms MS [--info FILE] -- COMMAND..."
action=$1; shift
case $action in
    install) install_tools; exit 0 ;;
    run) ;;
    *) die "unknown action '$action' (install or run)" ;;
esac

export_dir= mount_dir= rtt_ms= info=
while [ $# -gt 0 ]; do
    case $1 in
        --export) export_dir=$2; shift 2 ;;
        --mount) mount_dir=$2; shift 2 ;;
        --rtt-ms) rtt_ms=$2; shift 2 ;;
        --info) info=$2; shift 2 ;;
        --) shift; break ;;
        *) die "unknown option '$1'" ;;
    esac
done
[ -n "$export_dir" ] && [ -d "$export_dir" ] || die "--export must be an existing folder (got '$export_dir')"
[ -n "$mount_dir" ] || die "--mount is required"
[ -n "$rtt_ms" ] || die "--rtt-ms is required"
[ $# -ge 1 ] || die "no command given after --"
[ "$(id -u)" -eq 0 ] || die "needs root (sshd, FUSE)"
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
[ -x "$SSHD" ] && command -v sshfs >/dev/null || die "sshd or sshfs missing: run '$0 install' first"
[ -e /dev/fuse ] || die "/dev/fuse is missing: FUSE does not work here"
proxy="$(cd "$(dirname "$0")" && pwd)/delay_proxy.py"
delay_s=$(python3 -c "import sys; print(float(sys.argv[1]) / 2000)" "$rtt_ms" 2>/dev/null) \
    || die "--rtt-ms must be a number (got '$rtt_ms')"
export_dir=$(cd "$export_dir" && pwd)
mkdir -p "$mount_dir"
mount_dir=$(cd "$mount_dir" && pwd)
! mountpoint -q "$mount_dir" || die "$mount_dir is already a mount point"

work=$(mktemp -d /tmp/dimd-netfs.XXXXXX)
mounted=0 child= sshd_pid=
cleanup() {
    local status=$?
    trap - EXIT INT TERM HUP
    if [ -n "$child" ] && kill -0 "$child" 2>/dev/null; then
        kill -TERM "$child" 2>/dev/null || true
        wait "$child" 2>/dev/null || true
    fi
    if [ "$mounted" = 1 ]; then
        fusermount3 -u "$mount_dir" 2>/dev/null || fusermount -u "$mount_dir" 2>/dev/null \
            || umount -l "$mount_dir" 2>/dev/null || say "could not unmount $mount_dir"
    fi
    if [ -n "$sshd_pid" ]; then kill "$sshd_pid" 2>/dev/null || true; wait "$sshd_pid" 2>/dev/null || true; fi
    rm -rf "$work"
    return $status
}
trap 'cleanup' EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap 'cleanup; exit 129' HUP

port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
ssh-keygen -q -t ed25519 -N '' -f "$work/host_key"
ssh-keygen -q -t ed25519 -N '' -f "$work/client_key"
cp "$work/client_key.pub" "$work/authorized_keys"
cat >"$work/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $work/host_key
AuthorizedKeysFile $work/authorized_keys
PidFile none
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
Subsystem sftp internal-sftp
LogLevel ERROR
EOF
mkdir -p /run/sshd
"$SSHD" -D -f "$work/sshd_config" -E "$work/sshd.log" &   # not daemonised: our child, stopped by PID
sshd_pid=$!
for _ in $(seq 50); do
    python3 -c "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1).close()" \
        "$port" 2>/dev/null && break
    kill -0 "$sshd_pid" 2>/dev/null || die "sshd did not start: $(cat "$work/sshd.log")"
    sleep 0.1
done

sshfs "root@127.0.0.1:$export_dir" "$mount_dir" -p "$port" \
    -o ProxyCommand="python3 $proxy 127.0.0.1 %p $delay_s" \
    -o IdentityFile="$work/client_key" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
    -o BatchMode=yes -o LogLevel=ERROR -o Compression=no -o Ciphers=aes128-gcm@openssh.com \
    || die "sshfs mount failed"
mounted=1

# one file-system request: stat a name that does not exist (sshfs has to ask the server)
measured=$(python3 - "$mount_dir" <<'PY'
import os, statistics, sys, time, uuid
times = []
for _ in range(15):
    start = time.perf_counter()
    try:
        os.stat(os.path.join(sys.argv[1], f".dimd-netfs-probe-{uuid.uuid4().hex}"))
    except FileNotFoundError:
        pass
    times.append((time.perf_counter() - start) * 1e3)
print(f"{statistics.median(times):.3f}")
PY
)
say "sshfs 127.0.0.1:$port:$export_dir on $mount_dir, $rtt_ms ms round trip added;" \
    "one request (stat) takes $measured ms"
if [ -n "$info" ]; then
    printf '{"port": %s, "rtt_ms": %s, "request_ms_measured": %s, "delay": "bench/delay_proxy.py", "sshfs": "%s"}\n' \
        "$port" "$rtt_ms" "$measured" "$(sshfs --version 2>&1 | head -1)" >"$info"
fi

"$@" &
child=$!
set +e
wait "$child"
status=$?
set -e
child=
exit $status
