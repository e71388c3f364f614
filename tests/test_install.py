"""
The systemd install a person follows (C{docs/operations.md}, "Under
systemd"), performed as written in a fresh root, and the unit as installed.

- The documented block runs as written, with C{bash -euo pipefail}, from a
  copy of this checkout, with its three variables (C{PYTHON}, C{PREFIX},
  C{UNIT_DIR}) pointing into a temporary root instead of C{/opt} and
  C{/etc}: the system's C{python3 -m venv}, C{pip install .} (dependencies
  from the configured index), the plugin cache, the unit rewritten to the
  prefix.
- C{systemd-analyze verify} accepts the installed unit, whose C{ExecStart}
  names the environment's C{twistd}; that command runs (C{--help}), from the
  environment alone (no C{PYTHONPATH}).
- The plugin cache: with the whole environment read-only (what
  C{ProtectSystem=strict} makes it), the broker starts without "Unable to
  write to plugin cache"; without the cache the same start logs it (so the
  check can fail).
- C{ProtectProc=invisible}: on kernels without C{SO_PEERPIDFD} the broker
  reads C{/proc/PID/stat} of callers of any UID; under a C{/proc} mounted
  C{hidepid=invisible} only group 0's exemption lets a root without
  capabilities see them, so the unit keeps group 0 (a control run without
  the exemption is refused).
- Beside a node agent pinned to protobuf 6 (opentelemetry-proto 1.42 asks
  for C{protobuf<7}), installing the package keeps protobuf 6 (it once
  upgraded it to 7 and broke C{pip check}), and the NRI plugin's messages
  load and round-trip on that 6 and, in the same environment, on 7.
- The base install requires no protobuf (only the NRI plugin uses it, through
  the C{nri} extra): into a fresh environment, offline from the wheels of
  L{wheelhouse}, it installs none; it resolves beside an agent that pins
  protobuf 4 (opentelemetry-proto 1.27) or 5 and leaves that protobuf as it
  is, C{pip check} clean (it once required protobuf 6.30 or newer:
  C{ResolutionImpossible}); there C{twistd hostpid-nri} stops with one line
  naming the extra, and with the extra installed it runs.
- The C{hostpid} command: a plain script on the environment's C{PATH} whose
  C{#!} names the environment's interpreter; C{hostpid probe} run as the
  kubelet runs it loads no C{re} (pip's console-script wrapper did) nor any
  other module the exec probe must not pay for.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import pytest
import wheelhouse
from support import (
    REPO,
    WAIT_SECONDS,
    as_user_argv,
    require_root,
    require_tool,
    skip_or_fail,
    subprocess_env,
    twistd_argv,
    wait_for,
)
from test_cli import heavy_modules
from test_deploy import UNIT, restricted_prefix, unit_value, unit_values
from test_doc_examples import parse

#: The Python the documented install uses on Debian 12: the system's.
SYSTEM_PYTHON = Path("/usr/bin/python3")
#: What Twisted logs when it cannot save the plugin cache.
CACHE_COMPLAINT = "Unable to write to plugin cache"
#: The path the shipped unit names, which the install rewrites to its prefix.
SHIPPED_PREFIX = "/opt/hostpid"
#: A clean environment for the installed commands: nothing of this checkout.
CLEAN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def install_block() -> str:
    """The block the docs mark as run by this file."""
    blocks, _ = parse(REPO / "docs" / "operations.md")
    (block,) = [b for b in blocks if b.reason is not None and "tests/test_install.py" in b.reason]
    assert block.language == "sh"
    return block.code


@attrs.frozen
class Installed:
    root: Path
    prefix: Path
    unit: Path
    log: str

    @property
    def exec_start(self) -> list[str]:
        lines = [line for line in self.unit.read_text().splitlines()
                 if line.startswith("ExecStart=")]
        (line,) = lines
        return shlex.split(line.removeprefix("ExecStart="))

    @property
    def plugin_cache(self) -> Path:
        (cache,) = self.prefix.glob("venv/lib/python3*/site-packages/twisted/plugins/dropin.cache")
        return cache


def system_python() -> Path:
    if not SYSTEM_PYTHON.exists():
        skip_or_fail(f"{SYSTEM_PYTHON} is missing: the documented install uses the system's")
    done = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys, venv, ensurepip; print(sys.version_info >= (3, 11))"],
        capture_output=True, text=True, timeout=60)
    if done.stdout.strip() != "True":
        skip_or_fail(f"{SYSTEM_PYTHON} is older than 3.11 or has no venv/ensurepip: "
                     f"{done.stderr.strip() or done.stdout.strip()}")
    return SYSTEM_PYTHON


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The documented steps, once, in a fresh root."""
    require_root()
    python = system_python()
    root = tmp_path_factory.mktemp("root")
    checkout = root / "src" / "hostpid"
    shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".tox", ".pytest_cache",
        ".hypothesis", "dropin.cache"))
    prefix = root / "opt" / "hostpid"
    unit_dir = root / "etc" / "systemd" / "system"
    unit_dir.mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PATH=f"{Path(python).parent}:{CLEAN_PATH}", PYTHON=str(python),
               PREFIX=str(prefix), UNIT_DIR=str(unit_dir))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", install_block()], cwd=checkout,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return Installed(root, prefix, unit_dir / UNIT.name, done.stdout + done.stderr)


def test_the_install_block_is_the_documented_one() -> None:
    """The variables the test sets are the ones the docs name, with these defaults."""
    block = install_block()
    assert "PREFIX=${PREFIX:-/opt/hostpid}" in block
    assert "UNIT_DIR=${UNIT_DIR:-/etc/systemd/system}" in block
    assert "PYTHON=${PYTHON:-python3}" in block
    assert unit_value("ExecStart").startswith(f"{SHIPPED_PREFIX}/venv/bin/twistd ")


def test_the_installed_unit_names_the_environment_and_verifies(installed: Installed) -> None:
    argv = installed.exec_start
    assert argv[0] == str(installed.prefix / "venv" / "bin" / "twistd")
    assert Path(argv[0]).is_file() and os.access(argv[0], os.X_OK)
    assert argv[1:4] == ["--nodaemon", "--pidfile=", "hostpid-broker"]
    text = installed.unit.read_text()
    assert text == UNIT.read_text().replace(f"{SHIPPED_PREFIX}/", f"{installed.prefix}/"), \
        "every path of the prefix rewritten, nothing else"
    assert oct(installed.unit.stat().st_mode & 0o777) == "0o644"
    analyze = require_tool("systemd-analyze")
    done = subprocess.run([analyze, "verify", str(installed.unit)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout + done.stderr == ""


def test_the_installed_exec_start_runs_from_the_environment_alone(installed: Installed) -> None:
    env = {"PATH": CLEAN_PATH}
    done = subprocess.run([*installed.exec_start, "--help"], env=env, cwd=installed.root,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--log-format" in done.stdout and "--directory" in done.stdout
    where = subprocess.run(
        [str(installed.prefix / "venv" / "bin" / "python"), "-c",
         "import hostpid, twisted.plugins.hostpid_broker as p; print(hostpid.__file__); "
         "print(p.__file__)"],
        env=env, cwd=installed.root, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(installed.prefix)) for line in where.stdout.splitlines()), \
        where.stdout


@attrs.frozen
class Started:
    returncode: int
    output: str


def start_read_only(installed: Installed, directory: Path) -> Started:
    """
    The installed ExecStart's broker (gate off: it starts, says so, serves
    nothing), in a private mount namespace where the whole prefix is
    read-only, as C{ProtectSystem=strict} makes it; stopped with SIGTERM.
    """
    unshare = require_tool("unshare")
    script = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && '
              'exec "$@"')
    argv = [unshare, "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
            str(installed.prefix), *installed.exec_start[:4], "--directory", str(directory)]
    log = directory.parent / f"{directory.name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, env={"PATH": CLEAN_PATH, "LIBVGPU_HOSTPID_BROKER": "0"},
                                   stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, cwd=installed.root)
    try:
        wait_for(lambda: process.poll() is not None or "disabled" in log.read_text(),
                 "the broker to say it is disabled")
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=WAIT_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return Started(returncode, log.read_text())


def test_the_plugin_cache_is_written_at_install(installed: Installed, tmp_path: Path) -> None:
    cache = installed.plugin_cache
    assert cache.stat().st_uid == 0 and cache.stat().st_size > 0
    started = start_read_only(installed, tmp_path / "with-cache")
    assert started.returncode == -signal.SIGTERM, started.output
    assert "hostpid-broker: disabled" in started.output
    assert CACHE_COMPLAINT not in started.output
    # Without the cache, the same start cannot save it and says so: the check above can fail.
    aside = tmp_path / "dropin.cache"
    shutil.move(cache, aside)
    try:
        started = start_read_only(installed, tmp_path / "without-cache")
    finally:
        shutil.move(aside, cache)
    assert started.returncode == -signal.SIGTERM, started.output
    assert CACHE_COMPLAINT in started.output


# --- ProtectProc=invisible: the broker still reads other users' /proc entries -----------


def test_the_unit_keeps_group_0_under_protect_proc() -> None:
    """
    C{ProtectProc=invisible} hides from the service what it may not ptrace,
    except for group 0 (procfs's C{gid=}, which systemd leaves at 0): the
    broker must keep group 0 to read its callers' C{/proc/PID/stat}.
    """
    assert unit_value("ProtectProc") == "invisible"
    for key in ("Group", "User", "DynamicUser", "SupplementaryGroups"):
        assert unit_values(key) == [], f"{key}= must not be set"


#: A UID 1000 caller that sends its request a few clock ticks after connecting, so
#: that the broker's pidfd_open check cannot settle within the accept's tick and reads
#: the caller's start time from /proc; prints the reply's length and status.
LATE_CALLER = """
import socket, sys, time
from hostpid import wire
with socket.socket(socket.AF_UNIX) as s:
    s.settimeout(5)
    s.connect(sys.argv[1])
    time.sleep(0.05)
    s.sendall(wire.GET_HOST_PID_REQUEST)
    reply = b""
    while chunk := s.recv(64):
        reply += chunk
print(len(reply), wire.parse_response(reply).status if len(reply) == 12 else "-")
"""


@pytest.mark.parametrize("options, answered", [
    ("hidepid=invisible", True),
    # The control: group 0 no longer exempt, the caller's entry is hidden.
    ("hidepid=invisible,gid=4242", False),
], ids=["as ProtectProc=invisible mounts it", "without the group 0 exemption"])
def test_the_broker_reads_other_users_start_times_under_protect_proc(
    public_tmp: Path, options: str, answered: bool
) -> None:
    """
    The broker as the unit runs it (root, group 0, no capability,
    no_new_privs) with the C{pidfd_open} liveness check of kernels before
    6.5, over a C{/proc} mounted as C{ProtectProc=invisible} mounts it, in
    its own mount namespace; a UID 1000 caller whose request comes a few
    ticks after its connect is answered.  Without group 0's exemption the
    same caller is refused (its start time cannot be read, so the broker
    takes it for gone): what the unit's comment warns of.
    """
    require_root()
    unshare = require_tool("unshare")
    directory = public_tmp / "broker"
    script = 'mount -t proc -o "$1" proc /proc && shift && exec "$@"'
    argv = [unshare, "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
            options, *restricted_prefix(), *twistd_argv("--directory", str(directory))]
    env = subprocess_env(LIBVGPU_HOSTPID_BROKER="1",
                         HOSTPID_BROKER_TEST_LIVENESS="pidfd_open")
    with broker_process(argv, env, public_tmp / "broker.log") as log:
        socket_path = directory / "broker.sock"
        wait_for(lambda: "listening on" in log.read_text(), "the broker to listen")
        caller = subprocess.run(
            as_user_argv(1000, [sys.executable, "-c", LATE_CALLER, str(socket_path)]),
            env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert caller.returncode == 0, caller.stderr
        assert caller.stdout.split() == (["12", "0"] if answered else ["0", "-"]), \
            log.read_text()


@contextlib.contextmanager
def broker_process(argv: Sequence[str], env: dict[str, str], log: Path) -> Iterator[Path]:
    with log.open("wb") as out:
        process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        yield log
        assert process.poll() is None, log.read_text()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=WAIT_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# --- The hostpid command as installed: a plain script, as cheap as the probe ----------------


def imported_by(argv: Sequence[str], env: dict[str, str], cwd: Path) -> tuple[
    subprocess.CompletedProcess[str], set[str]
]:
    """C{argv} run with C{PYTHONPROFILEIMPORTTIME}: its result and every module it imported."""
    done = subprocess.run(argv, env={**env, "PYTHONPROFILEIMPORTTIME": "1"}, cwd=cwd,
                          capture_output=True, text=True, timeout=60)
    modules = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
               if line.startswith("import time:") and not line.endswith("imported package")}
    return done, modules


def test_the_installed_command_probes_without_loading_re(
    installed: Installed, tmp_path: Path
) -> None:
    """
    C{hostpid}, as C{pip install} puts it on the environment's C{PATH},
    runs C{hostpid probe} as the kubelet's exec probe does (the command
    itself, a fresh interpreter) and loads none of the modules
    C{test_cli.PROBE_NEVER_LOADS} names beyond what the bare interpreter
    loads: no C{re} from a console-script wrapper.  The control runs the
    same probe behind a wrapper like pip's (C{import re, sys}), which the
    same check sees.
    """
    bin_directory = installed.prefix / "venv" / "bin"
    command = bin_directory / "hostpid"
    shebang = command.read_text().splitlines()[0]
    assert shebang.startswith("#!") and Path(shebang[2:]).parent == bin_directory, \
        f"the script's #!python is the environment's interpreter: {shebang}"
    env = {"PATH": f"{bin_directory}:{CLEAN_PATH}"}
    assert shutil.which("hostpid", path=env["PATH"]) == str(command)
    version = subprocess.run(["hostpid", "--version"], env=env, cwd=installed.root,
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == "hostpid 0.1.0", version
    directory = tmp_path / "broker"
    socket_path = directory / "broker.sock"
    argv = [*installed.exec_start[:4], "--directory", str(directory)]
    with broker_process(argv, {"PATH": CLEAN_PATH, "LIBVGPU_HOSTPID_BROKER": "1"},
                        tmp_path / "broker.log") as log:
        wait_for(lambda: "listening on" in log.read_text(), "the broker to listen")
        probe = ["probe", "--socket", str(socket_path), "--timeout", "3"]
        done, loaded = imported_by(["hostpid", *probe], env, installed.root)
        wrapped = "import re, sys\nfrom hostpid.cli import main\nsys.exit(main())\n"
        control, control_loaded = imported_by(["python", "-c", wrapped, *probe], env,
                                              installed.root)
        doctor = subprocess.run(["hostpid", "doctor", "--socket", str(socket_path)], env=env,
                                cwd=installed.root, capture_output=True, text=True, timeout=60)
    _, interpreter = imported_by(["python", "-c", "pass"], env, installed.root)
    assert done.returncode == 0 and ": ok: answered PID " in done.stdout, done.stderr
    assert heavy_modules(loaded, interpreter) == []
    assert control.returncode == 0, control.stderr
    assert "re" in heavy_modules(control_loaded, interpreter)
    # The other subcommands run from the script too (the argparse path).
    assert doctor.returncode == 1, doctor.stderr  # no gate, no read-only mount here
    assert doctor.stdout.startswith("gate FAIL "), doctor.stdout


#: A node agent's package that pins protobuf's previous major (C{protobuf<7.0,>=5.0}).
PINNED_AGENT = "opentelemetry-proto==1.42.0"
#: What the smoke check runs with the environment's interpreter: the plugin's
#: options load, and a CreateContainer request round-trips through the
#: generated messages.  Prints the protobuf runtime's version.
NRI_SMOKE = """
import google.protobuf
from hostpid.nri import api_pb2, tap
request = api_pb2.CreateContainerRequest(container=api_pb2.Container(name="c", env=["A=B"]))
again = api_pb2.CreateContainerRequest.FromString(request.SerializeToString())
assert again.container.env == ["A=B"], again
tap.Options().parseOptions(["--resource", "nvidia.com/gpu"])
print(google.protobuf.__version__)
"""


def test_the_install_keeps_an_agents_protobuf_6(installed: Installed,
                                                 tmp_path: Path) -> None:
    """
    One environment (the documented install's interpreter, this checkout's
    copy): the agent first, then the package, then protobuf 7 over it.
    """
    venv = tmp_path / "venv"
    subprocess.run([str(system_python()), "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=900)

    def protobuf_after_smoke() -> str:
        done = run(str(venv / "bin" / "python"), "-c", NRI_SMOKE)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    agent = run(*pip, "install", PINNED_AGENT)
    assert agent.returncode == 0, agent.stderr
    done = run(*pip, "install", str(installed.root / "src" / "hostpid"))
    assert done.returncode == 0, done.stderr
    assert protobuf_after_smoke().startswith("6."), "the install replaced the agent's protobuf"
    check = run(*pip, "check")
    assert check.returncode == 0, check.stdout + check.stderr
    seven = run(*pip, "install", "protobuf>=7,<8")
    assert seven.returncode == 0, seven.stderr
    assert protobuf_after_smoke().startswith("7.")


@attrs.frozen
class Offline:
    """This tree's wheel and the dependencies' wheels: installs with C{--no-index}."""

    wheel: Path
    dependencies: Path

    def pip(self, venv: Path) -> list[str]:
        return [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                "--disable-pip-version-check", "-q"]

    def install(self, venv: Path, *requirements: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.pip(venv), "install", "--no-index", "--find-links", str(self.dependencies),
             *requirements], capture_output=True, text=True, timeout=600, env=clean_env())


def clean_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "PIP_FIND_LINKS")}


@pytest.fixture(scope="module")
def offline(installed: Installed, tmp_path_factory: pytest.TempPathFactory) -> Offline:
    """The documented install's checkout as a wheel, beside the cached dependencies."""
    try:
        dependencies = wheelhouse.dependencies()
    except subprocess.CalledProcessError as error:
        skip_or_fail(f"the dependencies' wheels could not be downloaded: {error.stderr[-2000:]}")
    out = tmp_path_factory.mktemp("wheel")
    return Offline(wheelhouse.package_wheel(installed.root / "src" / "hostpid", out), dependencies)


def fresh_environment(path: Path) -> Path:
    """A bare environment of the documented install's interpreter (pip runs from outside)."""
    subprocess.run([str(system_python()), "-m", "venv", "--without-pip", str(path)],
                   check=True, timeout=120)
    return path


def run_in(venv: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], capture_output=True,
                          text=True, timeout=120, cwd=venv, env=clean_env())


def protobuf_version(venv: Path) -> str | None:
    done = run_in(venv, "python", "-c", "import google.protobuf as p; print(p.__version__)")
    return done.stdout.strip() if done.returncode == 0 else None


def test_the_base_install_has_no_protobuf_and_twistd_names_the_extra(
        offline: Offline, tmp_path: Path) -> None:
    from hostpid import nri

    venv = fresh_environment(tmp_path / "venv")
    done = offline.install(venv, str(offline.wheel))
    assert done.returncode == 0, done.stderr
    assert protobuf_version(venv) is None
    check = subprocess.run([*offline.pip(venv), "check"], capture_output=True, text=True,
                           timeout=120, env=clean_env())
    assert check.returncode == 0, check.stdout + check.stderr
    assert run_in(venv, "twistd", "hostpid-broker", "--version").returncode == 0
    missing = run_in(venv, "twistd", "hostpid-nri", "--help")
    assert missing.returncode == 1
    assert missing.stderr.splitlines() == [
        "twistd hostpid-nri: " + nri.protobuf_problem(None)], missing.stderr
    assert "'nri' extra" in missing.stderr
    # With the extra, the plugin runs.
    done = offline.install(venv, f"{offline.wheel}[nri]")
    assert done.returncode == 0, done.stderr
    present = run_in(venv, "twistd", "hostpid-nri", "--help")
    assert present.returncode == 0, present.stderr


@pytest.mark.parametrize(("pin", "major"), [
    ("opentelemetry-proto==1.27.0", "4."), ("protobuf>=5.29,<6", "5.")])
def test_the_base_install_keeps_an_older_protobuf_pin(
        offline: Offline, tmp_path: Path, pin: str, major: str) -> None:
    venv = fresh_environment(tmp_path / "venv")
    done = offline.install(venv, pin, str(offline.wheel))
    assert done.returncode == 0, done.stderr
    assert (protobuf_version(venv) or "").startswith(major), protobuf_version(venv)
    check = subprocess.run([*offline.pip(venv), "check"], capture_output=True, text=True,
                           timeout=120, env=clean_env())
    assert check.returncode == 0, check.stdout + check.stderr
