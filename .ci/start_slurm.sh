#!/usr/bin/env bash
# Start a Slurm test cluster on this machine (Debian/Ubuntu, run as root) for the Slurm tests.
#
# One node (default): munged + slurmctld + slurmd in this machine's namespaces, the node being
# this host (NodeAddr 127.0.0.1).
#
# N nodes (--nodes N, N >= 2): this machine is the "login node" (munged, slurmctld, the
# driver); every compute node is a network + UTS namespace with its own hostname
# (<prefix>001, ...) and address on a bridge, running its own slurmd (per-node spool, pid and
# log files: Slurm expands %n). Node names resolve through a block in /etc/hosts. The
# filesystem is shared, as Lustre is on a real cluster.
#
#   .ci/start_slurm.sh                  # idempotent: reuses a running cluster
#   .ci/start_slurm.sh --nodes 2        # two compute nodes nid001, nid002 on 10.231.0.0/24
#   . /tmp/frontier-llm-slurm/env       # exports SLURM_CONF (and the cluster's facts)
#   .ci/stop_slurm.sh                   # same --state-dir as the start
#   .ci/start_slurm.sh --stop-node nid002   # a node crash: its slurmd and every process in
#   .ci/start_slurm.sh --start-node nid002  # its namespace killed; then its slurmd back
#
# Options (multi-node only unless said otherwise):
#   --nodes N         compute nodes (default 1)
#   --state-dir DIR   state directory, both modes (default $FRONTIER_LLM_SLURM_DIR or
#                     /tmp/frontier-llm-slurm)
#   --port P          slurmctld port P, slurmd port P+1 (default 6817)
#   --subnet A.B.C    bridge subnet A.B.C.0/24: login node A.B.C.1, node i A.B.C.(10+i)
#                     (default 10.231.0)
#   --prefix NAME     node hostname prefix, also names the bridge, namespaces and links
#                     (default nid)
#   --stop-node NAME  on the running cluster: SIGKILL node NAME's slurmd and every process in
#                     its namespace (job steps, ranks), as a crashed node; nothing else changes
#   --start-node NAME on the running cluster: start node NAME's slurmd again and wait until
#                     the node takes jobs (ReturnToService=2 returns a DOWN node to service)
# Settings (environment):
#   SLURM_TEST_CPUS   CPUs each node advertises (default: max(8, nproc)); more than the real
#                     cores so several ranks fit on a 2-core box.
set -euo pipefail

NODES=1
STATE_DIR="${FRONTIER_LLM_SLURM_DIR:-/tmp/frontier-llm-slurm}"
PORT=6817
SUBNET=10.231.0
PREFIX=nid
NODE_ACTION=""
ACTION_NODE=""
usage() { sed -n '2,36p' "$0" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nodes) NODES="$2"; shift 2 ;;
        --state-dir) STATE_DIR="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --subnet) SUBNET="$2"; shift 2 ;;
        --prefix) PREFIX="$2"; shift 2 ;;
        --stop-node) NODE_ACTION=stop; ACTION_NODE="$2"; shift 2 ;;
        --start-node) NODE_ACTION=start; ACTION_NODE="$2"; shift 2 ;;
        -h|--help) usage ;;
        *) echo "[start_slurm] unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
if ! [[ "$NODES" =~ ^[0-9]+$ ]] || (( NODES < 1 || NODES > 200 )); then
    echo "[start_slurm] --nodes must be an integer from 1 to 200, not '$NODES'" >&2; exit 2
fi
if ! [[ "$SUBNET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    echo "[start_slurm] --subnet must be three octets like 10.231.0, not '$SUBNET'" >&2; exit 2
fi
if ! [[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,5}$ ]]; then
    echo "[start_slurm] --prefix must be 1-6 lowercase letters/digits, not '$PREFIX'" >&2
    exit 2
fi

CONF="$STATE_DIR/slurm.conf"
ENV_FILE="$STATE_DIR/env"
HOSTS_FILE=/etc/hosts
LOGIN="$(hostname -s)"
LOGIN_ADDR="$SUBNET.1"
BRIDGE="fl-$PREFIX-br"

log() { echo "[start_slurm] $*"; }
node_name() { printf '%s%03d' "$PREFIX" "$1"; }
node_addr() { echo "$SUBNET.$(( 10 + $1 ))"; }

if [[ "$(id -u)" != 0 ]]; then
    echo "[start_slurm] must run as root (Slurm daemons and munged)" >&2
    exit 1
fi

# --- nodes: readiness, a node's slurmd ------------------------------------------------------
ready() { [[ "$1" == idle* || "$1" == mix* || "$1" == alloc* ]]; }

wait_node() {  # wait_node NAME: until slurmctld lets the node take jobs
    local name="$1" state="" _
    for _ in $(seq 120); do
        state="$(timeout 5 sinfo -h -n "$name" -o '%t' 2>/dev/null | head -1 || true)"
        ready "$state" && break
        if [[ "$state" == down* || "$state" == drain* ]]; then
            timeout 5 scontrol update NodeName="$name" State=RESUME >/dev/null 2>&1 || true
        fi
        sleep 0.5
    done
    if ! ready "$state"; then
        echo "[start_slurm] node $name not ready (state '$state'); see $STATE_DIR/log/" >&2
        exit 1
    fi
    log "node $name is $state"
}

start_node_slurmd() {  # start_node_slurmd NAME (multi-node)
    local name="$1"
    mkdir -p "$STATE_DIR/spool/$name"
    # A UTS namespace inside the node's network namespace: its own hostname, inherited by the
    # daemon and every job step it starts. nsenter, not "ip netns exec": that one remounts
    # /sys, hiding the cgroup filesystem slurmd needs.
    nsenter --net="/run/netns/fl-$name" unshare --uts \
        sh -c "hostname $name && exec slurmd -f '$CONF' -N $name"
}

if [[ -n "$NODE_ACTION" ]]; then
    # One node of the running multi-node cluster; its configuration is left as it is.
    export SLURM_CONF="$CONF"
    if [[ ! -s "$STATE_DIR/prefix" || ! -e "/run/netns/fl-$ACTION_NODE" ]]; then
        echo "[start_slurm] no node '$ACTION_NODE' in a multi-node cluster in $STATE_DIR" >&2
        exit 2
    fi
    pidfile="$STATE_DIR/slurmd-$ACTION_NODE.pid"
    if [[ "$NODE_ACTION" == stop ]]; then
        # SIGKILL, as a crash: slurmd tells slurmctld nothing, the job steps get no signal.
        [[ -s "$pidfile" ]] && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
        rm -f "$pidfile"
        for _ in $(seq 50); do
            pids="$(ip netns pids "fl-$ACTION_NODE" 2>/dev/null || true)"
            [[ -z "$pids" ]] && break
            # shellcheck disable=SC2086 # one pid per word
            kill -9 $pids 2>/dev/null || true
            sleep 0.1
        done
        log "node $ACTION_NODE stopped (slurmd and every process in fl-$ACTION_NODE killed)"
    else
        if [[ -s "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
            log "node $ACTION_NODE: slurmd already running"
        else
            start_node_slurmd "$ACTION_NODE"
        fi
        wait_node "$ACTION_NODE"
    fi
    exit 0
fi

# --- packages -------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v sinfo >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$STATE_DIR"/{state,spool,log}

# --- munge ----------------------------------------------------------------------------------
if ! (munge -n 2>/dev/null | unmunge >/dev/null 2>&1); then
    log "starting munged"
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey -c -f -k /etc/munge/munge.key
    fi
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        (munge -n 2>/dev/null | unmunge >/dev/null 2>&1) && break
        sleep 0.1
    done
    (munge -n | unmunge >/dev/null) || { echo "[start_slurm] munged did not start" >&2; exit 1; }
fi

# --- slurm.conf -----------------------------------------------------------------------------
REAL_CPUS="$(nproc)"
CPUS="${SLURM_TEST_CPUS:-$(( REAL_CPUS > 8 ? REAL_CPUS : 8 ))}"
# RealMemory must not exceed what slurmd detects (MB); stay a little below it.
DETECTED_MB="$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)"
MEM_MB=$(( ${DETECTED_MB:-2048} * 9 / 10 ))

if (( NODES == 1 )); then
    NODE_NAMES=("$(hostname -s)")
    CTLD_HOST="$LOGIN(127.0.0.1)"
    HEADER="a one-node test cluster on $LOGIN"
    SLURMD_PID="$STATE_DIR/slurmd.pid"
    SLURMD_LOG="$STATE_DIR/log/slurmd.log"
    SPOOL="$STATE_DIR/spool"
    NODE_LINES="NodeName=${NODE_NAMES[0]} NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
    PART_NODES="${NODE_NAMES[0]}"
else
    NODE_NAMES=()
    NODE_LINES=""
    for i in $(seq "$NODES"); do
        NODE_NAMES+=("$(node_name "$i")")
        NODE_LINES+="NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") CPUs=$CPUS"
        NODE_LINES+=" RealMemory=$MEM_MB State=UNKNOWN"$'\n'
    done
    NODE_LINES="${NODE_LINES%$'\n'}"
    CTLD_HOST="$LOGIN($LOGIN_ADDR)"
    HEADER="$NODES compute nodes (network + UTS namespaces) on $BRIDGE, login node $LOGIN"
    SLURMD_PID="$STATE_DIR/slurmd-%n.pid"
    SLURMD_LOG="$STATE_DIR/log/slurmd-%n.log"
    SPOOL="$STATE_DIR/spool/%n"
    PART_NODES="$PREFIX[$(printf '%03d' 1)-$(printf '%03d' "$NODES")]"
fi

NEW_CONF="$(cat <<EOF
# Generated by .ci/start_slurm.sh: $HEADER.
ClusterName=frontier-llm-test
SlurmctldHost=$CTLD_HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE_DIR/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
# Advertise more CPUs than the box has so several one-CPU ranks fit (tests only).
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$SLURMD_LOG
SlurmctldDebug=info
SlurmdDebug=info
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$SPOOL
SlurmctldPort=$PORT
SlurmdPort=$(( PORT + 1 ))
MinJobAge=600
KillWait=5
# A node whose slurmd stops answering is DOWN (and its jobs NODE_FAIL) after 15 s, not the
# default 5 minutes: the node-loss test waits for it. ReturnToService=2 above returns it to
# service as soon as its slurmd registers again. JobRequeue stays Slurm's default (1), as on
# most sites: the project's blocks ask for --no-requeue themselves (workflows.executors).
SlurmdTimeout=15
InactiveLimit=0
$NODE_LINES
PartitionName=debug Nodes=$PART_NODES Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
)"

pid_alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
slurmd_pidfile() {
    if (( NODES == 1 )); then echo "$STATE_DIR/slurmd.pid"; else echo "$STATE_DIR/slurmd-$1.pid"; fi
}

daemons_up() {
    pid_alive "$STATE_DIR/slurmctld.pid" || return 1
    local name
    for name in "${NODE_NAMES[@]}"; do
        pid_alive "$(slurmd_pidfile "$name")" || return 1
        if (( NODES > 1 )); then ip netns pids "fl-$name" >/dev/null 2>&1 || return 1; fi
    done
}

running() { [[ -f "$CONF" && "$(cat "$CONF")" == "$NEW_CONF" ]] && daemons_up; }

# Settings the daemons take on "scontrol reconfigure": a change to these (and comments) alone
# is applied to the running cluster in place, so its jobs live on.
RECONFIGURABLE='SlurmdTimeout|JobRequeue|ReturnToService|KillWait|MinJobAge|InactiveLimit'
only_settings_changed() {
    [[ -f "$CONF" ]] || return 1
    local other="^(#|($RECONFIGURABLE)=)"
    [[ "$(grep -vE "$other" "$CONF")" == "$(grep -vE "$other" <<<"$NEW_CONF")" ]]
}

# --- the compute nodes' namespaces (multi-node) --------------------------------------------
hosts_block() {
    local i
    echo "# BEGIN frontier-llm-slurm $PREFIX"
    for i in $(seq "$NODES"); do echo "$(node_addr "$i") $(node_name "$i")"; done
    # The login side of the bridge too: a reverse lookup of an address no file names goes to
    # DNS, which this machine may not answer (c10d's lookup of a peer then waits 10 s).
    echo "$LOGIN_ADDR $PREFIX-login"
    echo "# END frontier-llm-slurm $PREFIX"
}

write_hosts() {
    # Replace this cluster's block (the file is rewritten in place: it may be a bind mount).
    local kept
    kept="$(sed "/^# BEGIN frontier-llm-slurm $PREFIX\$/,/^# END frontier-llm-slurm $PREFIX\$/d" \
        "$HOSTS_FILE")"
    printf '%s\n%s\n' "$kept" "$(hosts_block)" > "$HOSTS_FILE"
}

make_network() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
    fi
    ip addr replace "$LOGIN_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local i name addr ns host_end node_end
    for i in $(seq "$NODES"); do
        name="$(node_name "$i")"; addr="$(node_addr "$i")"
        ns="fl-$name"; host_end="$ns-h"; node_end="$ns-n"
        ip netns del "$ns" 2>/dev/null || true
        ip link del "$host_end" 2>/dev/null || true
        ip netns add "$ns"
        ip link add "$host_end" type veth peer name "$node_end"
        ip link set "$host_end" master "$BRIDGE"
        ip link set "$host_end" up
        ip link set "$node_end" netns "$ns"
        ip netns exec "$ns" ip link set lo up
        ip netns exec "$ns" ip addr add "$addr/24" dev "$node_end"
        ip netns exec "$ns" ip link set "$node_end" up
        ip netns exec "$ns" ip route add default via "$LOGIN_ADDR"
        unreachable_nameservers "$ns"
    done
    write_hosts
}

# This machine's nameservers are not reachable from a node (nothing forwards its packets),
# so a lookup the hosts block cannot answer waits out the resolver's timeouts: c10d's reverse
# lookup of a peer's IPv4-mapped address, twice as the ranks meet, cost 20 s a rendezvous.
# An unreachable route makes such a lookup fail at once, as a cluster's nameserver answers.
unreachable_nameservers() {
    local server
    for server in $(awk '$1 == "nameserver" && $2 ~ /^[0-9.]+$/ && $2 !~ /^127\./ {print $2}' \
                    /etc/resolv.conf 2>/dev/null); do
        ip netns exec "$1" ip route replace unreachable "$server/32"
    done
}

start_slurmds() {
    local name
    if (( NODES == 1 )); then
        slurmd -f "$CONF"
        return
    fi
    for name in "${NODE_NAMES[@]}"; do
        start_node_slurmd "$name"
    done
}

if running; then
    log "already running (state in $STATE_DIR)"
elif daemons_up && only_settings_changed; then
    printf '%s\n' "$NEW_CONF" > "$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    SLURM_CONF="$CONF" scontrol reconfigure
    log "running; settings changed, reconfigured in place (state in $STATE_DIR)"
else
    # A stale or differently configured cluster: stop it first.
    stop_args=(--state-dir "$STATE_DIR")
    (( NODES > 1 )) && stop_args+=(--prefix "$PREFIX")
    "$(dirname "$0")/stop_slurm.sh" "${stop_args[@]}" >/dev/null 2>&1 || true
    # Without the controller's saved state job ids start again from 1, so the last
    # cluster's slurmd and job completion records would name this one's jobs.
    rm -f "$STATE_DIR"/log/*.log "$STATE_DIR/log/jobcomp.txt"
    printf '%s\n' "$NEW_CONF" > "$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    export SLURM_CONF="$CONF"
    if (( NODES > 1 )); then
        log "creating $NODES node namespaces on $BRIDGE ($SUBNET.0/24)"
        make_network
        # stop_slurm.sh reads these to remove what was made.
        printf '%s\n' "$PREFIX" > "$STATE_DIR/prefix"
    fi
    log "starting slurmctld and $NODES slurmd ($CPUS CPUs advertised each, state in $STATE_DIR)"
    slurmctld -f "$CONF"
    start_slurmds
fi
export SLURM_CONF="$CONF"

# --- wait for the nodes ---------------------------------------------------------------------
for name in "${NODE_NAMES[@]}"; do
    wait_node "$name"
done

if (( NODES == 1 )); then
    printf 'export SLURM_CONF=%s\n' "$CONF" > "$ENV_FILE.tmp"
else
    {
        printf 'export SLURM_CONF=%s\n' "$CONF"
        # For the multi-node tests: how many nodes, and where the login node is reachable from
        # them (the address Parsl's interchange must listen on: site.address).
        printf 'export FRONTIER_LLM_SLURM_NODES=%s\n' "$NODES"
        printf 'export FRONTIER_LLM_SLURM_LOGIN_ADDR=%s\n' "$LOGIN_ADDR"
    } > "$ENV_FILE.tmp"
fi
mv "$ENV_FILE.tmp" "$ENV_FILE"
log "env file: $ENV_FILE (source it, or set SLURM_CONF=$CONF)"
