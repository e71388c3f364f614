"""
The NRI plugin with the host as the chart's pod shows it: the lock parent
alone, writable, at its host path, in a read-only tree; the real plugin
process (C{twistd hostpid-nri}) in its own mount namespace, a fake runtime
on a real Unix socket (L{nrilib.FakeRuntime}).

Why it exists: the chart mounted the lock parent's parent (the host's
C{/tmp}, with other services' C{systemd-private-*} directories; a
schema-valid C{/var/vgpulock} gave the plugin the host's C{/var}) writable
into the root plugin container.  Now it mounts the lock parent itself, and
this shows that the plugin still does its whole job there: on a lock parent
kubelet has just created (root's, 0755: C{DirectoryOrCreate}) with a
tenant's symlink at the broker mountpoint, the first GPU container is
adjusted with both mounts, the symlink is replaced by a root-owned 0755
directory (its target untouched), the lock parent is 01777, and the plugin
can write nothing above it (the tree around is read-only).

Then the host removes the lock parent and makes it again (an operator, a
C{/tmp} cleaner): the pod's mount still shows the removed one, which says
nothing of what the runtime will mount; the next container gets no broker
mount and C{/healthz} fails, naming the path, so that the kubelet restarts
the container and binds the new one.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

from nrilib import FakeRuntime, NRIPluginProcess, gpu_container, http_get, pod, unfreeze
from support import WAIT_SECONDS, require_root, require_tool

from hostpid.nri import api_pb2

#: Runs as root in a new, private mount namespace: a read-only tmpfs at $1
#: standing for the container's own read-only root, with the host's lock
#: parent $2 bound at $1/vgpulock (rw), then the plugin ("$@" after them).
VIEW = r'''
set -e
view=$1 host=$2
shift 2
mount -t tmpfs -o mode=0755 hostpid-view "$view"
mkdir "$view/vgpulock"
mount --bind "$host" "$view/vgpulock"
mount -o remount,ro,bind "$view"
mount -o remount,ro "$view"
if touch "$view/written" 2>/dev/null; then echo "the view is writable"; exit 3; fi
exec "$@"
'''


def test_the_plugin_repairs_with_the_lock_parent_alone(tmp_path: Path) -> None:
    require_root()
    unshare = require_tool("unshare")
    (tmp_path / "broker").mkdir()
    host = tmp_path / "host" / "vgpulock"
    host.mkdir(parents=True)
    os.chmod(host, 0o755)  # as kubelet's DirectoryOrCreate makes it
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "kept").write_text("never touched")
    (host / "hostpid").symlink_to(target)
    os.lchown(host / "hostpid", 1000, 1000)
    view = tmp_path / "view"
    view.mkdir()
    wrapper = [unshare, "--mount", "--propagation", "private", "sh", "-c", VIEW, "sh",
               str(view), str(host)]
    with FakeRuntime(tmp_path / "nri.sock") as runtime, NRIPluginProcess(
            tmp_path / "nri.sock", ["--broker-dir", str(tmp_path / "broker"),
                                    "--lock-parent", str(view / "vgpulock"),
                                    "--health", f"unix:{tmp_path / 'health.sock'}"],
            wrapper=wrapper) as process:
        connection = runtime.accept(WAIT_SECONDS)
        connection.handshake()
        adjustment = connection.create_container(pod(), gpu_container()).adjust
        assert [m.destination for m in adjustment.mounts] == [
            "/tmp/vgpulock", "/tmp/vgpulock/hostpid"], process.output()
        entry = os.lstat(host / "hostpid")
        assert stat.S_ISDIR(entry.st_mode) and entry.st_uid == 0, process.output()
        assert stat.S_IMODE(entry.st_mode) == 0o755
        assert stat.S_IMODE(os.stat(host).st_mode) == 0o1777
        assert (target / "kept").read_text() == "never touched"
        assert "repaired the broker mountpoint" in process.output()
        # Nothing of the view but the lock parent was writable to the plugin.
        in_view = subprocess.run(
            ["nsenter", "-t", str(process.pid), "-m", "sh", "-c",
             f"touch {view}/x 2>&1; touch {view}/vgpulock/.probe && rm {view}/vgpulock/.probe"],
            capture_output=True, text=True, timeout=WAIT_SECONDS)
        assert "Read-only file system" in in_view.stdout and in_view.returncode == 0, in_view
        assert http_get(tmp_path / "health.sock", "/healthz")[0] == 200

        unfreeze(host)
        shutil.rmtree(host)
        host.mkdir()
        assert connection.create_container(pod(), gpu_container()).adjust == \
            api_pb2.ContainerAdjustment()
        code, body = http_get(tmp_path / "health.sock", "/healthz")
        assert code == 503 and f"{view}/vgpulock was removed on the host" in body, body
        assert "removed on the host since this container started" in process.output()
    assert sorted(os.listdir(view)) == [], "the view was the namespace's alone"
