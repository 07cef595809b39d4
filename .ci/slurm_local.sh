#!/usr/bin/env bash
# A throw-away SLURM cluster on this machine (munged + slurmctld + one slurmd per node), everything under one
# directory: its config, state, spool, logs, sockets and pid files. Nothing is written to /etc or /var and no system
# service is touched, so it runs in a container without systemd and beside a real SLURM (its ports are picked free).
#
#   .ci/slurm_local.sh start DIR [NODES]  start munged, slurmctld and NODES slurmd (2), each slurmd a node with all
#                                         this machine's CPUs; wait until they are idle; print `export SLURM_CONF=...`
#   .ci/slurm_local.sh stop DIR           cancel every job, stop the daemons and end whatever of them is left
#
# Clients (sbatch, srun, scontrol, squeue) find this cluster through SLURM_CONF=DIR/slurm.conf; a job inherits it.
# Needs the Debian/Ubuntu package slurm-wlm (slurmctld, slurmd, the clients, munge) and root (slurmd starts jobs
# as their user). tests/launch/test_slurm.py uses it; so can a person (docs/clusters.md).
set -euo pipefail

usage() { echo "usage: $0 start DIR [NODES] | stop DIR" >&2; exit 2; }
[[ $# -eq 2 || ($# -eq 3 && $1 == start) ]] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
nodes=${3:-2}
conf=$dir/slurm.conf
export SLURM_CONF=$conf

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Which processes belong to this cluster, never found by name: the daemons and their slurmstepd (started with
# ACCEL_TRAIN_SLURM_LOCAL=DIR in their environment) and the jobs' processes (SLURM_CONF=DIR/slurm.conf and a
# SLURM_JOB_ID), which can outlive a stopped slurmd. A shell that merely exported SLURM_CONF is not one.
ours() {
    local pid env
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        [[ $(cut -d')' -f2 2>/dev/null < "/proc/$pid/stat") == " Z "* ]] && continue  # exited, not yet reaped
        env=$(tr '\0' '\n' 2>/dev/null < "/proc/$pid/environ") || continue  # gone, or not ours to read
        if grep -qxF "ACCEL_TRAIN_SLURM_LOCAL=$dir" <<< "$env" \
            || { grep -qxF "SLURM_CONF=$conf" <<< "$env" && grep -q '^SLURM_JOB_ID=' <<< "$env"; }; then
            echo "$pid"
        fi
    done
    return 0
}

write_conf() {
    local host=$1 cpus=$2 i
    cat <<EOF
# Written by .ci/slurm_local.sh: a one-machine cluster for tests. Not a template for a real cluster.
ClusterName=accel-train-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmUser=root
SlurmdUser=root
# munged started by this script, on a socket of its own. cred_expire is also how long a requeued job waits before
# it may start again (120 s by default), so it is short here.
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.sock,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: processes are tracked through their parent pids, which also finds the workers that
# torch's launcher starts in sessions of their own (proctrack/pgid would lose them).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
# Look at pending jobs every 2 s, not every 60 s: a requeued job starts again as soon as it may.
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# A job may be requeued (scontrol requeue, or preemption): SLURM sends SIGTERM, then SIGKILL KillWait s later.
JobRequeue=1
KillWait=30
# A finished job stays visible to scontrol for 10 minutes (the tests read its restart count).
MinJobAge=600
# $nodes nodes, each a slurmd of its own on this machine, with all its CPUs (jobs use them in turn: --exclusive).
EOF
    for i in $(seq 1 "$nodes"); do
        echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=node[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
}

start() {
    if [[ -n $(ours) ]]; then
        echo "slurm_local: a cluster of $dir is running already; stop it first: $0 stop $dir" >&2
        return 1
    fi
    mkdir -p "$dir"/{run,log,state,spool,munge}
    chmod 711 "$dir/munge"  # others may reach the socket, not list the key
    local mark=ACCEL_TRAIN_SLURM_LOCAL=$dir  # in the daemons' environment only: marks them as ours (see `ours`)
    # A fresh MUNGE key and daemon of our own: the system's (if any) is neither needed nor touched.
    [[ -f $dir/munge/munge.key ]] || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$dir/munge/munge.key"
    env "$mark" munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
    write_conf "$(hostname -s)" "$(nproc)" > "$conf"
    env "$mark" slurmctld -f "$conf"
    local i state
    for i in $(seq 1 "$nodes"); do env "$mark" slurmd -f "$conf" -N "node$i"; done
    for _ in $(seq 1 60); do
        state=$(sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ')
        if [[ $state == "idle " ]]; then
            echo "export SLURM_CONF=$conf"
            return 0
        fi
        sleep 0.5
    done
    echo "slurm_local: the nodes did not become idle (state: '${state:-none}'); logs in $dir/log" >&2
    tail -n 20 "$dir"/log/*.log >&2 || true
    stop
    return 1
}

stop() {
    local jobs pid pids
    jobs=$( [[ -f $conf ]] && squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
        # shellcheck disable=SC2086
        scancel --quiet --full --signal=KILL $jobs 2>/dev/null || true
        # shellcheck disable=SC2086
        scancel --quiet $jobs 2>/dev/null || true
        for _ in $(seq 1 20); do  # let slurmd reap the jobs' steps before it goes
            [[ -z $(squeue -h 2>/dev/null || true) ]] && break
            sleep 0.5
        done
    fi
    for pid in $(cat "$dir"/run/*.pid 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 1 20); do
        pids=$(ours)
        [[ -z $pids ]] && break
        sleep 0.5
    done
    pids=$(ours)
    if [[ -n $pids ]]; then
        echo "slurm_local: SIGKILL to what is left: $pids" >&2
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 1
    fi
    rm -f "$dir"/run/*.pid
    pids=$(ours)
    if [[ -n $pids ]]; then
        echo "slurm_local: still running after SIGKILL: $pids" >&2
        return 1
    fi
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
