#!/usr/bin/env bash
# A one-node Slurm on this machine, for tests/test_slurm.py and for trying `--emit slurm`
# scripts: Debian's slurmctld and slurmd with munge, started as root without systemd (CI
# runs in a container). Idempotent: exits at once when this node already answers as idle.
# Needs root (apt-get, daemons). The node claims 16 CPUs whatever the machine has
# (`config_overrides`): a test job's processes are light, and two 2-core tasks must fit.
set -euo pipefail

node=$(hostname -s)
if sinfo -h -N -n "$node" -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    echo "== slurm: $node is up"
    exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmd slurmctld slurm-client munge \
        >/dev/null
fi

# munge: the key the package made (or a fresh one), the daemon as its own user.
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 \
    status=none; chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key; }
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
munge -n | unmunge >/dev/null  # fails here, not later inside slurmctld, if munge is broken

install -d -m 0755 /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=jdist
SlurmctldHost=$node
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire + 1 s before it may start again (default 120 s, most of a
# requeue test's time): 10 s here.
AuthInfo=cred_expire=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# No cgroups in a container: track processes by parent id, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
# Seconds between the SIGTERM of a cancel or requeue and the SIGKILL: time to checkpoint.
KillWait=60
NodeName=$node CPUs=16 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF

pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 60); do
    state=$(sinfo -h -N -n "$node" -o %T 2>/dev/null || true)
    case "$state" in
        idle*|mixed*|allocated*) echo "== slurm: $node is up ($state)"; exit 0 ;;
        down*|drain*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
done
echo "slurm did not come up: node $node is '${state:-unknown}'; see /var/log/slurm/" >&2
exit 1
