#!/bin/sh
# The guest's PID 1 after switch_root (tests/kernels/initramfs.py): the host's
# root, read-only under a tmpfs overlay.  It sets up what systemd would give a
# service (the kernel file systems, a tmpfs /tmp and /run, loopback, a
# descriptor limit of 1024 soft / 524288 hard), runs the job that
# tests/kernels/vm.py wrote into the job share, writes the results there and
# powers the machine off.  Nothing it writes reaches the host except through
# the job share: the overlay's upper layer is guest memory.
#
# With INIT=systemd in the job, it hands PID 1 to the host's own systemd
# instead, which runs the job as a service of its own (this script again,
# with --job): the tests then drive a real service manager with systemctl.
JOB=/mnt/hostpid-job
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8

poweroff() {
    sync
    echo o > /proc/sysrq-trigger
    sleep 60
}

run_job() {
    cd "$WORKTREE" || poweroff
    cut -d' ' -f1 /proc/uptime > "$JOB/tests-started-at"
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words quoted by vm.py
    eval "set -- $PYTEST_ARGS"
    # The kernel's features are probed by the same pytest (tests/kernelfeatures.py).
    timeout --kill-after=10 "$GUEST_TIMEOUT" env HOSTPID_REQUIRE_PRIVILEGED=1 HOSTPID_KERNEL_MATRIX=0 \
        PYTHONUNBUFFERED=1 HOSTPID_TIME_SCALE="$TIME_SCALE" HOSTPID_FEATURES_FILE="$JOB/features.json" \
        HOSTPID_REPEAT="${REPEAT:-1}" HOSTPID_TEST_CAP="${TEST_CAP:-}" \
        "$PYTHON" -m pytest -p no:cacheprovider --junitxml="$JOB/junit.xml" "$@" \
        > "$JOB/pytest.log" 2>&1
    echo $? > "$JOB/pytest.rc"
    cut -d' ' -f1 /proc/uptime > "$JOB/tests-ended-at"
    if [ -n "${CANARY:-}" ]; then
        # Writes where the host must not see them (tests/kernels/guest_canary.py).
        env HOSTPID_KERNEL_MATRIX=0 "$PYTHON" -I "$CANARY" > "$JOB/canary.log" 2>&1
        echo $? > "$JOB/canary.rc"
    fi
}

if [ "$1" = "--job" ]; then
    # Started by systemd (below): the mounts are in place already.
    . "$JOB/job.env"
    run_job
    poweroff
fi

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=000 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t cgroup2 cgroup2 /sys/fs/cgroup
. "$JOB/job.env"
# A checkout under /tmp or /run (CI clones into a temporary folder) would be
# hidden by the guest's own tmpfs there: keep it reachable at the same path.
mkdir -p /mnt/hostpid-worktree
mount --bind "$WORKTREE" /mnt/hostpid-worktree
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=0755 tmpfs /run
if [ ! -d "$WORKTREE/tests" ]; then
    mkdir -p "$WORKTREE"
    mount --bind /mnt/hostpid-worktree "$WORKTREE"
fi
ip link set lo up
cut -d' ' -f1 /proc/uptime > "$JOB/booted-at"

prlimit --pid $$ --nofile=1024:524288
uname -r > "$JOB/uname"
# The host's /tmp/vgpulock as the guest sees it: through the read-only lower
# layer, shadowed here by the guest's own tmpfs /tmp (absent unless a test
# makes one).  vm.py compares the host's before and after the run.
if [ "${INIT:-}" = "systemd" ]; then
    # The host's systemd as PID 1, starting nothing but the job.  What the
    # tests' units pull in (sysinit.target) must not undo this script's
    # setup: the host's fstab (which names the host's disks) is emptied in
    # the overlay, and the boot-time cleaning of /tmp (tmpfiles' "D /tmp"),
    # which would remove the job's files there, is masked.
    : > /etc/fstab
    # No generator either: the guest has no disks, swap, consoles or init
    # scripts to make units for, and each daemon-reload runs them all under
    # emulation (one, probing for GPT partitions, once crashed the emulated
    # kernel).  A generator linked to /dev/null under /etc is disabled.
    mkdir -p /etc/systemd/system-generators
    for generator in /lib/systemd/system-generators/*; do
        ln -sf /dev/null "/etc/systemd/system-generators/${generator##*/}"
    done
    mkdir -p /run/systemd/system
    ln -sf /dev/null /run/systemd/system/systemd-tmpfiles-setup.service
    cat > /run/systemd/system/hostpid-guest-job.service <<UNIT
[Unit]
Description=hostpid kernel-matrix job
DefaultDependencies=no

[Service]
Type=exec
ExecStart=/bin/sh $0 --job
LimitNOFILE=1024:524288
StandardOutput=journal+console
UNIT
    exec /lib/systemd/systemd --unit=hostpid-guest-job.service --log-target=console
fi
run_job
poweroff
