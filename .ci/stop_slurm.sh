#!/usr/bin/env bash
# Stop the test cluster started by .ci/start_slurm.sh: its jobs (cancelled, and the
# controller's saved state removed, so a restart brings none back), every slurmd and
# slurmctld and, for a multi-node cluster, the processes left in the node namespaces, the
# namespaces, their links, the bridge and the cluster's /etc/hosts block. Removes the env
# file so the Slurm tests skip again. munged is left running (other tools may use it).
#
#   .ci/stop_slurm.sh [--state-dir DIR] [--prefix NAME]
#
# The state directory defaults to $FRONTIER_LLM_SLURM_DIR or /tmp/frontier-llm-slurm; the
# node prefix to the one start_slurm.sh recorded there (none for a one-node cluster).
set -uo pipefail

STATE_DIR="${FRONTIER_LLM_SLURM_DIR:-/tmp/frontier-llm-slurm}"
PREFIX=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --state-dir) STATE_DIR="$2"; shift 2 ;;
        --prefix) PREFIX="$2"; shift 2 ;;
        *) echo "[stop_slurm] unknown option $1" >&2; exit 2 ;;
    esac
done
if [[ -z "$PREFIX" && -s "$STATE_DIR/prefix" ]]; then
    PREFIX="$(cat "$STATE_DIR/prefix")"
fi

stop_pid() {  # stop_pid PID WHAT
    local pid="$1"
    kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid"
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    echo "[stop_slurm] stopped $2 ($pid)"
}

rm -f "$STATE_DIR/env"
# Jobs a killed test run left behind: cancel them while the controller still answers, and
# drop its saved state below, so the next start does not bring them back.
if [[ -s "$STATE_DIR/slurmctld.pid" ]] && kill -0 "$(cat "$STATE_DIR/slurmctld.pid")" 2>/dev/null; then
    jobs="$(SLURM_CONF="$STATE_DIR/slurm.conf" timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ')"
    if [[ -n "${jobs// }" ]]; then
        # shellcheck disable=SC2086  # one job id per word
        SLURM_CONF="$STATE_DIR/slurm.conf" timeout 10 scancel $jobs 2>/dev/null || true
        echo "[stop_slurm] cancelled jobs $jobs"
    fi
fi
shopt -s nullglob
for pidfile in "$STATE_DIR"/slurmd.pid "$STATE_DIR"/slurmd-*.pid "$STATE_DIR"/slurmctld.pid; do
    [[ -s "$pidfile" ]] && stop_pid "$(cat "$pidfile")" "$(basename "$pidfile" .pid)"
    rm -f "$pidfile"
done

# slurmctld's saved jobs, recovered on its next start otherwise (the directory stays), and
# with them the job-completion log: job ids start again at 1, and an old record of a reused
# id would read as the new job's end
[[ -d "$STATE_DIR/state" ]] && find "$STATE_DIR/state" -mindepth 1 -delete
rm -f "$STATE_DIR/log/jobcomp.txt"

[[ -n "$PREFIX" ]] || exit 0

# --- multi-node: namespaces, links, bridge, /etc/hosts --------------------------------------
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^fl-$PREFIX[0-9]{3}\$"); do
    # Job steps and workers the node's slurmd started and that outlived it.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
        stop_pid "$pid" "process in $ns"
    done
    ip netns del "$ns" && echo "[stop_slurm] removed namespace $ns"
done
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 \
        | grep -E "^fl-$PREFIX[0-9]{3}-h\$"); do
    ip link del "$link" 2>/dev/null || true
done
ip link del "fl-$PREFIX-br" 2>/dev/null && echo "[stop_slurm] removed bridge fl-$PREFIX-br"
if grep -q "^# BEGIN frontier-llm-slurm $PREFIX\$" /etc/hosts; then
    kept="$(sed "/^# BEGIN frontier-llm-slurm $PREFIX\$/,/^# END frontier-llm-slurm $PREFIX\$/d" \
        /etc/hosts)"
    printf '%s\n' "$kept" > /etc/hosts
fi
rm -f "$STATE_DIR/prefix"
exit 0
