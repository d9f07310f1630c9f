# Two hosts on this machine, h1 and h2: network namespaces joined by a veth pair on
# 10.200.0.0/24 (h1 10.200.0.1, h2 10.200.0.2) and no route anywhere else. Sourced by
# tests/multihost/run.sh; needs root. Every name starts with $MULTIHOST_PREFIX, so that
# hosts_down removes exactly what hosts_up made.
#
# Each host's /etc/hosts is /etc/netns/PREFIXhN/hosts (ip netns exec puts it over /etc/hosts):
# both names with their real addresses, or with MULTIHOST_DEBIAN_HOSTS=1 as Debian's installer
# writes it, the host's own name on 127.0.1.1 first.

MULTIHOST_PREFIX=${MULTIHOST_PREFIX:-dimd-mh-}
export MULTIHOST_PREFIX
MULTIHOST_HOSTS=(h1 h2)

hosts_file() {   # hosts_file HOST: that host's /etc/hosts
    local me=$1
    echo "127.0.0.1 localhost"
    if [[ ${MULTIHOST_DEBIAN_HOSTS:-0} == 1 ]]; then echo "127.0.1.1 $me"; fi
    echo "10.200.0.1 h1"
    echo "10.200.0.2 h2"
}

hosts_up() {
    local h
    hosts_down
    for h in "${MULTIHOST_HOSTS[@]}"; do
        ip netns add "$MULTIHOST_PREFIX$h"
        mkdir -p "/etc/netns/$MULTIHOST_PREFIX$h"
        hosts_file "$h" >"/etc/netns/$MULTIHOST_PREFIX$h/hosts"
        ip -n "$MULTIHOST_PREFIX$h" link set lo up
    done
    hosts_link
}

hosts_link() {   # the veth pair between the hosts (again, after a test cut it: hosts_cut)
    local h i=1
    ip link add "${MULTIHOST_PREFIX}v1" type veth peer name "${MULTIHOST_PREFIX}v2"
    for h in "${MULTIHOST_HOSTS[@]}"; do
        ip link set "${MULTIHOST_PREFIX}v$i" netns "$MULTIHOST_PREFIX$h"
        ip -n "$MULTIHOST_PREFIX$h" addr add "10.200.0.$i/24" dev "${MULTIHOST_PREFIX}v$i"
        ip -n "$MULTIHOST_PREFIX$h" link set "${MULTIHOST_PREFIX}v$i" up
        i=$((i + 1))
    done
}

hosts_cut() {   # h2 leaves the network, as a dead node does: its end of the veth pair (and so the pair) goes
    ip -n "${MULTIHOST_PREFIX}h2" link del "${MULTIHOST_PREFIX}v2"
}

hosts_down() {   # idempotent: removes whatever of ours is there
    local h
    for h in "${MULTIHOST_HOSTS[@]}"; do
        if [[ -e /var/run/netns/$MULTIHOST_PREFIX$h ]]; then
            ip netns pids "$MULTIHOST_PREFIX$h" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
            ip netns del "$MULTIHOST_PREFIX$h" 2>/dev/null || true
        fi
        rm -rf "/etc/netns/$MULTIHOST_PREFIX$h"
    done
    ip link del "${MULTIHOST_PREFIX}v1" 2>/dev/null || true
    rmdir /etc/netns 2>/dev/null || true   # only when empty: it may hold other namespaces' files
}
