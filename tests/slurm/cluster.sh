#!/usr/bin/env bash
# A single-node Slurm cluster on localhost, shaped like OSC's, for the slurm tests.
#
#   sudo tests/slurm/cluster.sh up       # install (Debian/Ubuntu, first time), configure, start, check
#   sudo tests/slurm/cluster.sh status   # sinfo + sacctmgr; exit 1 when unhealthy
#   sudo tests/slurm/cluster.sh down     # stop every daemon this script started (by pid file)
#
# Daemons: munged, MariaDB + slurmdbd (the executor plugin checks job status with sacct, as on OSC),
# slurmctld, slurmd. Partitions carry OSC-like names (cpu = default, gpu, gpudebug) on the one node,
# which has two fake GPUs (gres files /dev/null and /dev/zero). No systemd needed; root needed.
# Every wait is bounded, so a broken cluster fails here with the log to read, never hangs.
set -euo pipefail

CLUSTER=actstore
ACCOUNT=${ACTSTORE_TEST_ACCOUNT:-pas1234}
NODE=$(hostname -s)
# The node is declared bigger than this machine (config_overrides) so that the OSC profile's real
# requests (cpus, memory, time) fit; nothing is enforced without cgroups, which this test does not need.
NODE_CPUS=${ACTSTORE_TEST_NODE_CPUS:-16}
NODE_MEM_MB=${ACTSTORE_TEST_NODE_MEM_MB:-128000}
ETC=/etc/slurm
LOGDIR=/var/log/slurm
RUN=/run/actstore-slurm
DB_PASS=actstore-test   # a throwaway local database reachable only on 127.0.0.1
WAIT_S=${ACTSTORE_SLURM_WAIT_S:-60}

log() { echo "[slurm-cluster] $*" >&2; }
die() { log "ERROR: $*"; for f in "$LOGDIR"/*.log /var/log/munge/munged.log "$RUN"/mariadb.log; do
          [ -f "$f" ] && { echo "--- tail $f" >&2; tail -n 15 "$f" >&2; }; done; exit 1; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND once a second, fail after SECONDS.
wait_for() {
    local limit=$1 what=$2; shift 2
    for _ in $(seq "$limit"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
    die "timed out after ${limit}s waiting for $what"
}

install_packages() {
    local need=()
    for bin in slurmctld slurmd slurmdbd sbatch munged mariadbd; do command -v "$bin" >/dev/null || need+=("$bin"); done
    [ ${#need[@]} -eq 0 ] && return 0
    log "installing Slurm, munge, slurmdbd and MariaDB (missing: ${need[*]})"
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get update -qq
    timeout 900 apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client slurmdbd munge mariadb-server >/dev/null
}

write_configs() {
    mkdir -p "$ETC" "$LOGDIR" "$RUN" /var/lib/slurm/slurmctld /var/spool/slurmd
    cat >"$ETC/slurm.conf" <<EOF
# Written by tests/slurm/cluster.sh: one node on localhost, OSC-like partition names.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStorageEnforce=associations
AccountingStorageTRES=gres/gpu
JobCompType=jobcomp/none
MinJobAge=600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB Gres=gpu:2 State=UNKNOWN
PartitionName=cpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$NODE MaxTime=INFINITE State=UP
PartitionName=gpudebug Nodes=$NODE MaxTime=60 State=UP
EOF
    cat >"$ETC/gres.conf" <<EOF
# Fake GPUs: each needs a character device, or the node drains.
AutoDetect=off
NodeName=$NODE Name=gpu File=/dev/null
NodeName=$NODE Name=gpu File=/dev/zero
EOF
    rm -f "$ETC/cgroup.conf"   # 22.05 has no CgroupPlugin=disabled; task/none and linuxproc need none
    cat >"$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOGDIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$ETC/slurmdbd.conf"
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    running /run/munge/munged.pid && return 0
    mkdir -p /run/munge && chown munge: /run/munge
    [ -s /etc/munge/munge.key ] || { /usr/sbin/mungekey --create --force; chown munge: /etc/munge/munge.key; }
    runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1
    wait_for "$WAIT_S" munged munge -n
}

start_mariadb() {
    if ! running /run/mysqld/mysqld.pid; then
        mkdir -p /run/mysqld && chown mysql: /run/mysqld
        [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql >/dev/null
        setsid /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 \
            </dev/null >"$RUN/mariadb.log" 2>&1 &
        wait_for "$WAIT_S" MariaDB mariadb-admin ping
    fi
    mariadb -u root <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
}

start_slurm() {
    running "$RUN/slurmdbd.pid" || /usr/sbin/slurmdbd </dev/null >/dev/null 2>&1
    wait_for "$WAIT_S" slurmdbd timeout 10 sacctmgr -n list cluster
    timeout 20 sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
    timeout 20 sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" Description="actstore tests" >/dev/null 2>&1 || true
    timeout 20 sacctmgr -i add user root Account="$ACCOUNT" Cluster="$CLUSTER" >/dev/null 2>&1 || true
    timeout 10 sacctmgr -n -P list assoc user=root format=account | grep -qx "$ACCOUNT" \
        || die "sacctmgr has no association root/$ACCOUNT"
    running "$RUN/slurmctld.pid" || /usr/sbin/slurmctld </dev/null >/dev/null 2>&1
    wait_for "$WAIT_S" slurmctld timeout 10 scontrol ping
    running "$RUN/slurmd.pid" || /usr/sbin/slurmd -N "$NODE" </dev/null >/dev/null 2>&1
    wait_for "$WAIT_S" "node $NODE to register" node_usable
    # A node left drained by an earlier run would reject every job.
    timeout 10 scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
}

node_usable() {
    local state
    state=$(timeout 10 sinfo -h -n "$NODE" -o %T | head -1)
    case "$state" in idle*|mixed*|allocated*|completing*) return 0 ;; *) return 1 ;; esac
}

smoke_test() {
    # One real job on the gpu partition, waited for with a bound, then seen by sacct.
    local id
    id=$(timeout 20 sbatch --parsable -A "$ACCOUNT" -p gpu --gpus=1 -t 1 --mem=100 -o /dev/null \
         --wrap 'test -n "$CUDA_VISIBLE_DEVICES"') || die "sbatch refused the smoke-test job"
    wait_for "$WAIT_S" "smoke-test job $id to finish" job_done "$id"
    # slurmctld reports to slurmdbd asynchronously: sacct may lag the job's end by a few seconds.
    wait_for 30 "sacct to show job $id COMPLETED on gpu (see: sacct -j $id -o State,Partition,ExitCode)" \
        sacct_shows "$id" "COMPLETED *gpu"
}

sacct_shows() { timeout 10 sacct -n -X -j "$1" -o State,Partition | grep -q "$2"; }

job_done() { ! timeout 10 squeue -h -j "$1" 2>/dev/null | grep -q .; }

status() {
    timeout 10 scontrol ping && timeout 10 sinfo -s && node_usable \
        && timeout 10 sacctmgr -n -P list assoc user=root format=cluster,account
}

stop_pid() {
    local file=$1 name=$2
    running "$file" || return 0
    local pid; pid=$(cat "$file")
    log "stopping $name (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
}

down() {
    stop_pid "$RUN/slurmd.pid" slurmd
    stop_pid "$RUN/slurmctld.pid" slurmctld
    stop_pid "$RUN/slurmdbd.pid" slurmdbd
    stop_pid /run/mysqld/mysqld.pid mariadb
    stop_pid /run/munge/munged.pid munged
}

case "${1:-}" in
    up)
        [ "$(id -u)" = 0 ] || die "run as root (installs packages, writes $ETC, starts daemons)"
        install_packages
        write_configs
        start_munge
        start_mariadb
        start_slurm
        smoke_test
        timeout 10 sinfo -s
        log "cluster '$CLUSTER' up: account $ACCOUNT, partitions cpu (default), gpu, gpudebug" ;;
    status) status ;;
    down) down ;;
    *) echo "usage: $0 up|status|down" >&2; exit 2 ;;
esac
