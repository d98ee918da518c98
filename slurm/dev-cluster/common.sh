# Shared by `up` and `down`: where the dev cluster keeps its state, and its ports.
STATE=${VITCTL_DEV_CLUSTER:-/tmp/vitctl-dev-cluster}
CLUSTER=vitctl-dev
CTLD_PORT=16817
DBD_PORT=16819
DB_PORT=13306
NODES=(n1 n2)
NODE_PORTS=(17001 17002)
HOSTS_MARK="# vitctl dev cluster"
SYSTEM_CONF=/etc/slurm/slurm.conf
export SLURM_CONF=$STATE/etc/slurm.conf

alive() {  # alive PIDFILE NAME: the process the file names is running and is NAME (not a reused PID)
    [[ -s $1 ]] && [[ $(cat "/proc/$(cat "$1")/comm" 2>/dev/null) == "$2" ]]
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            echo "dev-cluster: $what did not come up; see $STATE/log" >&2
            return 1
        fi
        sleep 0.5
    done
}
