"""A throwaway single-node Ceph cluster serving S3 on 127.0.0.1, for the contract tests
against a real server (``nox -s ceph``; ``.ci/ceph`` installs Debian's packages).

One monitor, one OSD on memstore (its objects live in the OSD's memory) and the RADOS
Gateway with its beast frontend, each a foreground child process in a session of its own,
all configured by one ``ceph.conf`` in a fresh temporary directory, with cephx keys
generated for this cluster only. ``start`` waits on each daemon's readiness (the monitor
answers, the OSD is up, the gateway answers HTTP) under one deadline and raises
``RuntimeError`` naming the daemon and quoting the end of its log otherwise; ``stop`` kills
every process and removes the directory, whatever state ``start`` reached. A test run killed
outright takes the daemons with it (they die with their parent); only the directory stays.
"""

import base64
import ctypes
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["CephCluster", "missing_tools"]

TOOLS = ("ceph", "ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool")
_SBIN = ("/usr/bin", "/usr/sbin", "/bin", "/sbin")
_PR_SET_PDEATHSIG = 1

# Every entity's key and capabilities: the monitor's own, the admin the tests' commands
# run as, the OSD and the gateway.
_ENTITIES = {
    "mon.": {"mon": "allow *"},
    "client.admin": {"mon": "allow *", "osd": "allow *", "mgr": "allow *"},
    "osd.0": {"mon": "allow profile osd", "osd": "allow *", "mgr": "allow profile osd"},
    "client.rgw": {"mon": "allow rw", "osd": "allow rwx"},
}


def missing_tools() -> list[str]:
    """The Ceph programs this module runs that are on no usual path."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    return [tool for tool in TOOLS if shutil.which(tool, path=path) is None]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _cephx_key() -> str:
    # A cephx secret: type 1 (AES), creation time, then 16 random bytes, base64-encoded.
    header = struct.pack("<HIIH", 1, int(time.time()), 0, 16)
    return base64.b64encode(header + os.urandom(16)).decode()


def _keyring() -> str:
    sections = []
    for name, caps in _ENTITIES.items():
        lines = [f"[{name}]", f"\tkey = {_cephx_key()}"]
        lines += [f'\tcaps {daemon} = "{cap}"' for daemon, cap in caps.items()]
        sections.append("\n".join(lines))
    return "\n".join(sections) + "\n"


def _die_with_parent() -> None:
    # Runs in the child before exec: a daemon outliving a killed test run would hold its
    # ports and memory until someone noticed.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class CephCluster:
    """A monitor, a memstore OSD and a gateway in a temporary directory, with one S3 user
    whose keys are ``access_key`` and ``secret_key``; ``endpoint`` is the gateway's URL."""

    def __init__(self, access_key: str, secret_key: str) -> None:
        self._access_key = access_key
        self._secret_key = secret_key
        self._root = Path(tempfile.mkdtemp(prefix="ceph-"))
        self._conf = self._root / "ceph.conf"
        self._fsid = str(uuid.uuid4())
        self._mon_port = _free_port()
        self._rgw_port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self._rgw_port}"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])

    def start(self, timeout: float = 120.0) -> None:
        """Create the cluster and its S3 user; raises ``RuntimeError`` when a command fails
        or a daemon is not ready within ``timeout`` seconds in all (the caller still calls
        ``stop``)."""
        deadline = time.monotonic() + timeout
        self._write_config()
        monmap = str(self._root / "monmap")
        address = f"[v2:127.0.0.1:{self._mon_port}]"
        self._run("monmaptool", "--create", "--fsid", self._fsid, "--addv", "a", address, monmap)
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap)
        self._spawn("mon.a", "ceph-mon", "-f", "-i", "a")
        self._wait("mon.a", deadline, self._monitor_answers)
        osd_uuid = str(uuid.uuid4())
        self._run("ceph", "osd", "new", osd_uuid, "0")
        self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn("osd.0", "ceph-osd", "-f", "-i", "0")
        self._wait("osd.0", deadline, self._osd_up)
        self._spawn("client.rgw", "radosgw", "-f", "-n", "client.rgw")
        self._wait("client.rgw", deadline, self._gateway_answers)
        user = ["--uid", "tests", "--display-name", "tests"]
        keys = ["--access-key", self._access_key, "--secret-key", self._secret_key]
        self._run("radosgw-admin", "user", "create", *user, *keys)

    def stop(self) -> None:
        """Kill every daemon (SIGKILL to its session: memstore's data is thrown away
        anyway), reap it and remove the cluster's directory."""
        for process in self._daemons.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._daemons.clear()
        shutil.rmtree(self._root, ignore_errors=True)

    def _write_config(self) -> None:
        root = self._root
        for name in ("mon", "osd", "run", "log", "rgw"):
            (root / name).mkdir()
        (root / "keyring").write_text(_keyring())
        (root / "keyring").chmod(0o600)
        # One PG a pool and a map proposal every 50 ms: the gateway creates its pools one by
        # one as it starts, each waiting for a proposal and for its PGs to peer. The device
        # size is what the OSD reports, not memory taken: deleted objects' data stays until
        # the gateway's garbage collection, hours later, so the session's writes add up.
        self._conf.write_text(
            f"""[global]
fsid = {self._fsid}
mon host = v2:127.0.0.1:{self._mon_port}
public addr = 127.0.0.1
ms bind ipv6 = false
keyring = {root}/keyring
run dir = {root}/run
admin socket = {root}/run/$name.asok
pid file = {root}/run/$name.pid
log file = {root}/log/$name.log
mon data = {root}/mon
osd data = {root}/osd
osd objectstore = memstore
memstore device bytes = {8 * 2**30}
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
osd pool default pg num = 1
osd pool default pgp num = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
paxos propose interval = 0.05
[client.rgw]
rgw data = {root}/rgw
rgw frontends = beast endpoint=127.0.0.1:{self._rgw_port}
"""
        )

    def _command(self, tool: str, *args: str) -> list[str]:
        program = shutil.which(tool, path=self._path)
        if program is None:
            raise RuntimeError(f"{tool} is not installed: run .ci/ceph (as root) first")
        return [program, "--conf", str(self._conf), *args]

    def _run(self, tool: str, *args: str, timeout: float = 30.0) -> str:
        """``tool``'s standard output; raises ``RuntimeError`` quoting its error output
        when it fails or outlasts ``timeout`` seconds."""
        command = self._command(tool, *args)
        try:
            done = subprocess.run(
                command, capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(command)} took over {timeout:.0f} s") from None
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({done.returncode}): "
                f"{done.stderr.decode(errors='replace')[-2000:]}"
            )
        return done.stdout.decode()

    def _spawn(self, name: str, tool: str, *args: str) -> None:
        with open(self._root / "log" / f"{name}.out", "wb") as out:
            self._daemons[name] = subprocess.Popen(
                self._command(tool, *args),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def _wait(self, name: str, deadline: float, ready: Callable[[], bool]) -> None:
        """Poll ``ready`` until it holds; ``RuntimeError`` with the end of ``name``'s log
        when the daemon exits or ``deadline`` passes first."""
        while not ready():
            exited = self._daemons[name].poll()
            if exited is not None or time.monotonic() > deadline:
                why = f"exited with {exited}" if exited is not None else "was not ready in time"
                raise RuntimeError(f"ceph {name} {why}; its log ends:\n{self._log_tail(name)}")
            time.sleep(0.1)

    def _log_tail(self, name: str) -> str:
        lines: list[str] = []
        for path in (self._root / "log" / f"{name}.out", self._root / "log" / f"{name}.log"):
            if path.exists():
                lines += path.read_text(errors="replace").splitlines()[-15:]
        return "\n".join(lines)

    def _monitor_answers(self) -> bool:
        try:
            self._run("ceph", "--connect-timeout", "2", "mon", "stat", timeout=10.0)
        except RuntimeError:
            return False
        return True

    def _osd_up(self) -> bool:
        status = json.loads(self._run("ceph", "osd", "stat", "--format", "json"))
        return int(status.get("num_up_osds", 0)) == 1

    def _gateway_answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint, timeout=2.0):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer: the gateway is serving
        except OSError:
            return False
