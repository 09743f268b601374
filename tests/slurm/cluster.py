"""A two-node SLURM cluster on this machine, from Debian's packages, for testing apps/multinode_trainer.slurm.

Everything runs as root from one folder: munged (its own key and socket), MariaDB (its own data folder,
TCP on 127.0.0.1, no grants) under slurmdbd, so that `sacct` has records, slurmctld in this network
namespace, and two slurmd nodes, `n1` and `n2`, each in a network namespace of its own (and a UTS and
mount namespace, for its hostname and /etc/hosts). A veth pair per node joins it to a bridge, so the
rendezvous and gloo traffic between the nodes crosses a real interface (`titan0` inside each node):

    slurmctld, slurmdbd (host) 10.213.0.1 ── bridge titan-slurm0 ─┬─ veth ── n1 10.213.0.11 (slurmd)
                                                                  └─ veth ── n2 10.213.0.12 (slurmd)

Only one such cluster runs on a machine at a time (a lock file). `python tests/slurm/cluster.py up DIR`
starts one for manual use and `... down DIR` stops it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODES = {"n1": "10.213.0.11", "n2": "10.213.0.12"}
CONTROLLER_ADDR = "10.213.0.1"
PREFIX = 24
BRIDGE = "titan-slurm0"
NODE_IFNAME = "titan0"  # the node side of its veth pair, the same name in every node
GPUS_PER_NODE = 4  # GRES on stand-in device files: SLURM counts and hands them out, nothing more
LOCK = Path("/run/titan-slurm-test.lock")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
COMMANDS = (
    "munged",
    "munge",
    "unmunge",
    "mungekey",
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "sbatch",
    "sacct",
    "mariadbd",
    "mariadb-install-db",
)


def netns(node: str) -> str:
    return f"titan-slurm-{node}"


def host_veth(node: str) -> str:
    return f"tslurm-{node}"


def unavailable_reason() -> str | None:
    """Why no cluster can start here (None when one can, possibly after tests/slurm/install.sh)."""
    if sys.platform != "linux":
        return "a SLURM test cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the SLURM test cluster needs root (network namespaces, daemons); run the tests as root, as .ci/run does"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "the SLURM test cluster needs `ip` (iproute2) and `unshare` (util-linux)"
    probe = subprocess.run(["ip", "netns", "add", "titan-slurm-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces are not available here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "titan-slurm-probe"], capture_output=True)
    probe = subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:  # each node has its own hostname and /etc/hosts
        return f"UTS and mount namespaces are not available here: {probe.stderr.strip()}"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing and shutil.which("apt-get") is None:
        return f"SLURM is not installed ({', '.join(missing)} missing) and there is no apt-get to install it"
    return None


def install() -> None:
    """Install SLURM, munge and MariaDB from the distribution's packages (tests/slurm/install.sh) if missing."""
    if all(shutil.which(c) for c in COMMANDS):
        return
    result = subprocess.run(["bash", str(HERE / "install.sh")], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"tests/slurm/install.sh failed:\n{(result.stdout + result.stderr)[-3000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_if_running(pid: int, name: str) -> None:
    """SIGKILL `pid` if it is still the daemon `name` started (its command line names the program)."""
    program = name.split("-")[0]
    try:
        if program.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


class Cluster:
    """Start with `start()`, stop with `stop()` (also after a failed start: it removes whatever exists)."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self.daemons: dict[str, subprocess.Popen] = {}
        self._lock_fd: int | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment SLURM's commands need to find this cluster (sbatch passes it on to the jobs)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- start and stop ---------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> None:
        self._lock_fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # a second test session waits for the first
        self._remove_network()  # left over by a session that was killed before it could clean up
        for folder in ("state", "spool", "log", "munge", "db"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        db_port, dbd_port, ctl_port = _free_port(), _free_port(), _free_port()
        self._start_mariadb(db_port)
        self._write_config(db_port, dbd_port, ctl_port)
        self._daemon("slurmdbd", ["slurmdbd", "-D"])
        self._wait_for(lambda: self._ok("sacctmgr", "-i", "show", "cluster"), "slurmdbd", timeout)
        if "titan" not in self._run("sacctmgr", "--noheader", "show", "cluster", "format=cluster"):
            self._run("sacctmgr", "-i", "add", "cluster", "titan")
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "addr", "add", f"{CONTROLLER_ADDR}/{PREFIX}", "dev", BRIDGE)
        _sh("ip", "link", "set", BRIDGE, "up")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i"])
        self._wait_for(lambda: self._ok("scontrol", "ping"), "slurmctld", timeout)
        for node in NODES:
            self.start_node(node)
        self.wait_for_nodes("idle", timeout)

    def stop(self) -> None:
        """Kill every daemon and job process, remove the namespaces and the bridge; keeps the logs."""
        for node in NODES:
            self.kill_node(node)
        for name in reversed(list(self.daemons)):
            process = self.daemons.pop(name)
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
        for pid_file in sorted(self.root.glob("pids/*")):  # daemons that `cluster.py up` left running
            _kill_if_running(int(pid_file.read_text()), pid_file.name)
            pid_file.unlink()
        self._remove_network()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def start_node(self, node: str) -> None:
        """The node's namespace, its veth pair on the bridge, and its slurmd (which registers with slurmctld)."""
        ns, veth = netns(node), host_veth(node)
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns)
        _sh("ip", "link", "set", veth, "master", BRIDGE, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{NODES[node]}/{PREFIX}", "dev", NODE_IFNAME)
        _sh("ip", "-n", ns, "link", "set", NODE_IFNAME, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        hosts = self.root / f"hosts-{node}"
        hosts.write_text(
            "127.0.0.1 localhost\n"
            + f"{CONTROLLER_ADDR} {socket.gethostname()}\n"
            + "".join(f"{addr} {name}\n" for name, addr in NODES.items())
        )
        inside = f"mount --bind {hosts} /etc/hosts && hostname {node} && exec slurmd -D -N {node}"
        (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        # nsenter, not `ip netns exec`, which mounts a /sys without the cgroup file system slurmd reads.
        command = [
            "nsenter",
            f"--net=/run/netns/{ns}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            inside,
        ]
        self._daemon(f"slurmd-{node}", command)

    def kill_node(self, node: str) -> None:
        """The node dies: SIGKILL to every process in its namespace (slurmd, job steps, ranks), then the namespace goes."""
        ns = netns(node)
        if _sh("ip", "netns", "pids", ns, check=False).returncode != 0:
            return
        for _ in range(20):
            pids = [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        process = self.daemons.pop(f"slurmd-{node}", None)
        if process is not None:
            process.wait(timeout=30)
        _sh("ip", "netns", "del", ns, check=False)  # its veth pair goes with it

    def _remove_network(self) -> None:
        for node in NODES:
            self.kill_node(node)
            _sh("ip", "link", "del", host_veth(node), check=False)
        _sh("ip", "link", "del", BRIDGE, check=False)

    # -- the daemons ------------------------------------------------------------------------------

    def _daemon(self, name: str, command: list[str]) -> None:
        log = open(self.logs / f"{name}.out", "ab")
        self.daemons[name] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.root, start_new_session=True
        )
        log.close()
        (self.root / "pids").mkdir(exist_ok=True)
        (self.root / "pids" / name).write_text(str(self.daemons[name].pid))

    def _start_munge(self) -> None:
        """munged on its standard socket (SLURM 22.05's sacctmgr ignores AuthInfo's socket), or the running one."""
        if self._munge_works():
            return
        munge = self.root / "munge"
        munge.chmod(0o711)
        key = munge / "munge.key"
        if not key.exists():
            self._run("mungekey", "--create", f"--keyfile={key}")
        key.chmod(0o400)
        MUNGE_SOCKET.parent.mkdir(mode=0o755, exist_ok=True)
        self._daemon(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
                f"--log-file={self.logs / 'munged.log'}",
            ],
        )
        self._wait_for(self._munge_works, "munged", 30)

    @staticmethod
    def _munge_works() -> bool:
        encode = subprocess.run(["munge", "-n"], capture_output=True, timeout=30)
        if encode.returncode != 0:
            return False
        return (
            subprocess.run(["unmunge"], input=encode.stdout, capture_output=True, timeout=30).returncode == 0
        )

    def _start_mariadb(self, port: int) -> None:
        data = self.root / "db"
        if not (data / "mysql").exists():
            self._run(
                "mariadb-install-db",
                "--user=root",
                f"--datadir={data}",
                "--skip-test-db",
                "--auth-root-authentication-method=normal",
            )
        self._daemon(
            "mariadbd",
            [
                "mariadbd",
                "--no-defaults",
                "--user=root",
                f"--datadir={data}",
                f"--socket={data / 'mysqld.sock'}",
                f"--pid-file={data / 'mysqld.pid'}",
                f"--port={port}",
                "--bind-address=127.0.0.1",
                "--skip-grant-tables",
                "--innodb-buffer-pool-size=32M",
                "--innodb-log-file-size=16M",
            ],
        )

        def accepting() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        self._wait_for(accepting, "mariadbd", 60)

    def _write_config(self, db_port: int, dbd_port: int, ctl_port: int) -> None:
        r = self.root
        common = "AuthType=auth/munge\n"
        dbd = r / "slurmdbd.conf"
        dbd.write_text(
            f"{common}DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={dbd_port}\nSlurmUser=root\n"
            f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={db_port}\n"
            f"StorageUser=root\nStorageLoc=slurm_acct_db\nPidFile={r}/slurmdbd.pid\n"
            f"LogFile={self.logs}/slurmdbd.log\n"
        )
        dbd.chmod(0o600)
        nodes = "".join(
            f"NodeName={name} NodeHostname={name} NodeAddr={addr} CPUs={os.cpu_count()} Gres=gpu:{GPUS_PER_NODE}\n"
            for name, addr in NODES.items()
        )
        # SLURM 22.05 drops GPUs without device files; these stand-ins are /dev/null's device (1, 3).
        gpus = r / "gpus"
        gpus.mkdir(exist_ok=True)
        for index in range(GPUS_PER_NODE):
            if not (gpus / f"gpu{index}").exists():
                os.mknod(gpus / f"gpu{index}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (r / "gres.conf").write_text(
            f"NodeName={','.join(NODES)} Name=gpu File={gpus}/gpu[0-{GPUS_PER_NODE - 1}]\n"
        )
        self.conf.write_text(
            f"ClusterName=titan\nSlurmctldHost={socket.gethostname()}({CONTROLLER_ADDR})\n"
            f"SlurmctldPort={ctl_port}\nSlurmdPort=6818\nSlurmUser=root\nSlurmdUser=root\n{common}"
            "CredType=cred/munge\n"
            f"StateSaveLocation={r}/state\nSlurmdSpoolDir={r}/spool/%n\n"
            f"SlurmctldPidFile={r}/slurmctld.pid\nSlurmdPidFile={r}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={self.logs}/slurmctld.log\nSlurmdLogFile={self.logs}/slurmd-%n.log\n"
            "SlurmctldDebug=info\nSlurmdDebug=info\n"
            # no cgroups: processes are tracked by parentage, tasks are not bound
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/linux\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nGresTypes=gpu\n"
            f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
            f"AccountingStoragePort={dbd_port}\n"
            # Seconds where a cluster has minutes: a requeued job may start again after cred_expire (120 s
            # by default), the scheduler looks at pending jobs every sched_interval (60 s), a node that
            # stops answering is down after SlurmdTimeout (300 s). cred_expire is also how long a step's
            # credential stays valid: at 5 s, a node just restarted on a loaded machine (CI, 2026-11-26)
            # took 6 s to take its step ("Job credential expired") and the job never finished.
            "AuthInfo=cred_expire=20\nSchedulerType=sched/builtin\nSchedulerParameters=sched_interval=1\n"
            "SlurmdTimeout=10\nMpiDefault=none\nReturnToService=2\nJobRequeue=1\nKillWait=10\n"
            "MinJobAge=600\nInactiveLimit=0\n"
            f"{nodes}PartitionName=main Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP\n"
        )

    # -- SLURM commands ---------------------------------------------------------------------------

    def _run(self, *command: str, timeout: float = 60) -> str:
        result = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({result.returncode}): {result.stdout}{result.stderr}"
            )
        return result.stdout

    def _ok(self, *command: str) -> bool:
        return subprocess.run(command, capture_output=True, env=self.env, timeout=60).returncode == 0

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, process in self.daemons.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({process.returncode}) while waiting for {what}: {self.tail(name)}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready within {timeout} s")
            time.sleep(0.2)

    def tail(self, name: str, chars: int = 2000) -> str:
        path = self.logs / f"{name}.out"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def node_states(self) -> dict[str, str]:
        out = self._run("sinfo", "--noheader", "--Node", "--format=%N %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_for_nodes(self, state: str, timeout: float = 120) -> None:
        self._wait_for(lambda: set(self.node_states().values()) == {state}, f"nodes {state}", timeout)

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        result = subprocess.run(
            ["sbatch", "--parsable", *args],
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            cwd=cwd,
            timeout=60,
        )
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def release(self, job_id: int, timeout: float = 120) -> None:
        """Cancel the job if it is still queued or running and restart a node a test killed, so that a test
        which failed midway leaves the next one the cluster as it was started."""
        subprocess.run(["scancel", str(job_id)], capture_output=True, env=self.env, timeout=60)
        for node in NODES:
            if f"slurmd-{node}" not in self.daemons:
                self.start_node(node)
        self.wait_for_nodes("idle", timeout)

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); empty once the job is purged."""
        result = subprocess.run(
            ["scontrol", "--oneliner", "show", "job", str(job_id)],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if result.returncode != 0:
            return {}
        return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)

    def wait_for_job(self, job_id: int, states: set[str], timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} not in {states} within {timeout} s: {info.get('JobState')}"
                )
            time.sleep(0.5)

    def sacct(self, job_id: int) -> str:
        return self._run(
            "sacct",
            "--duplicates",
            "--allocations",
            "-j",
            str(job_id),
            "--format=JobID,JobName%8,State%10,ExitCode,Start,End,Elapsed,TotalCPU,NodeList%8",
        )

    def cpu_seconds(self, job_id: int) -> float:
        """CPU time (user + system) of every step of every start of the job, as SLURM accounted it."""
        out = self._run(
            "sacct", "--duplicates", "--noheader", "--parsable2", "-j", str(job_id), "--format=JobID,TotalCPU"
        )
        total = 0.0
        for line in out.split():
            step, cpu = line.split("|")
            if "." not in step:  # the allocation's own line; its steps (batch, extern, srun) hold the time
                continue
            days, _, clock = cpu.rpartition("-")
            parts = [float(x) for x in clock.split(":")]
            total += sum(v * u for v, u in zip(reversed(parts), (1, 60, 3600), strict=False))
            total += 86400 * int(days or 0)
        return total

    def command(self, *command: str) -> str:
        return self._run(*command)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: cluster.py up|down FOLDER", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    cluster = Cluster(Path(argv[1]))
    if argv[0] == "down":
        cluster.stop()
        return 0
    install()
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
