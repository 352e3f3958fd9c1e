#!/usr/bin/env bash
# Stop the one-node test cluster started by .ci/start_slurm.sh (slurmd, slurmctld) and remove
# its env file so the Slurm tests skip again. munged is left running (other tools may use it).
set -uo pipefail

STATE_DIR="${FRONTIER_LLM_SLURM_DIR:-/tmp/frontier-llm-slurm}"

rm -f "$STATE_DIR/env"
for daemon in slurmd slurmctld; do
    pidfile="$STATE_DIR/$daemon.pid"
    [[ -s "$pidfile" ]] || continue
    pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$pidfile"
    echo "[stop_slurm] stopped $daemon ($pid)"
done
