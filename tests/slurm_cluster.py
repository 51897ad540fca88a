"""A real Slurm cluster of several nodes on this machine, for the tests (``python -m tests.slurm_cluster`` starts
one by hand and prints how to use it).

Debian's slurm-wlm and munge, as root: a bridge carries the controller's address on the host; every node is a
network namespace (a veth pair into the bridge, its own address, interface ``eth0``) running ``slurmd -N name``
under its own UTS namespace, so a task's ``hostname`` is the node's name. The filesystem is the machine's, as a
cluster's shared filesystem would be. No accounting daemon: ``sacct`` has nothing, as on most small clusters.
The node names resolve through ``/etc/hosts`` lines that ``stop`` removes again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpumagic.launch.allocation import parse_fields

BRIDGE = "gmslurm0"
SUBNET = "10.77.0"
CONTROLLER_ADDRESS = f"{SUBNET}.1"
CONTROLLER_PORT = 16817
NODE_PORT = 16818
HOSTS_MARK = "# gpumagic test cluster"
NODE_INTERFACE = "eth0"  # what GLOO_SOCKET_IFNAME names for ranks on the nodes

SLURM_CONF = """\
ClusterName=gmtest
SlurmctldHost=gmctl({controller})
SlurmctldPort={controller_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool-%n
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd-%n.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge={min_job_age}
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
Waittime=0
MessageTimeout=10
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""
CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"


@dataclass
class Cluster:
    """A running cluster: its configuration (``SLURM_CONF`` for the commands), nodes and processes."""

    base: Path
    nodes: list[str]
    addresses: dict[str, str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    started_munge: subprocess.Popen | None = None

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    def environment(self) -> dict[str, str]:
        """What a process on the host needs to use the cluster (Slurm's commands, gloo on the nodes)."""
        return {"SLURM_CONF": str(self.conf), "GLOO_SOCKET_IFNAME": NODE_INTERFACE}

    def run(self, *command: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command (``squeue``, ``scontrol`` ...) against this cluster."""
        path = os.pathsep.join(["/usr/sbin", "/usr/bin", "/sbin", "/bin", os.environ.get("PATH", "")])
        return subprocess.run(
            command, env={**os.environ, **self.environment(), "PATH": path}, capture_output=True, text=True,
            check=check, timeout=timeout,
        )  # fmt: skip

    def node_pid(self, node: str) -> int:
        """The pid of ``node``'s slurmd."""
        return int((self.base / f"slurmd-{node}.pid").read_text().strip())

    def allocation(self, nodes: int, *, seconds: int = 1800) -> tuple[str, dict[str, str]]:
        """A job holding ``nodes`` nodes, as ``salloc`` would make on a login node, and the environment salloc
        gives the shell it starts there (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_NNODES`` ...)."""
        done = self.run("sbatch", "--parsable", f"-N{nodes}", "--ntasks-per-node=1", "-t", f"{seconds // 60}",
                        f"--output={self.base}/allocation-%j.out", "--wrap", f"sleep {seconds}")  # fmt: skip
        job_id = done.stdout.strip().split(";")[0]
        deadline = time.monotonic() + 60
        while True:
            fields = self.job_fields(job_id)
            if fields.get("JobState") == "RUNNING":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the allocation {job_id} did not start: {fields}")
            time.sleep(0.2)
        node_list = fields["NodeList"]
        env = {
            "SLURM_JOB_ID": job_id,
            "SLURM_JOBID": job_id,
            "SLURM_JOB_NODELIST": node_list,
            "SLURM_NODELIST": node_list,
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes),
            "SLURM_CLUSTER_NAME": "gmtest",
        }
        return job_id, env

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of a job ({} once the controller forgot it)."""
        done = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        return parse_fields(done.stdout)

    def stop(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        # the tasks slurmd started (a job still running when the cluster stops)
        subprocess.run(["pkill", "-KILL", "-f", "slurmstepd"], check=False)
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], check=False, capture_output=True)
        _set_hosts({})
        if self.started_munge is not None:
            self.started_munge.terminate()
            self.started_munge.wait(10)
        shutil.rmtree(self.base, ignore_errors=True)


def cannot_start() -> str | None:
    """Why no cluster can be started on this machine, or None."""
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (network namespaces, slurmd)"
    missing = [c for c in ("slurmctld", "slurmd", "munged", "sbatch", "ip", "unshare") if shutil.which(c) is None]
    if missing:
        return f"no {', '.join(missing)} here (apt-get install slurm-wlm munge iproute2)"
    return None


def start(nodes: int = 2, *, cpus: int = 4, min_job_age: int = 300) -> Cluster:
    """Start the controller and ``nodes`` nodes (``gmn1``, ``gmn2``, ...); wait until every node is idle.

    Raises:
        RuntimeError: a part did not start (its log's last lines).
    """
    reason = cannot_start()
    if reason:
        raise RuntimeError(reason)
    _remove_leftovers()
    base = Path(tempfile.mkdtemp(prefix="gpumagic-slurm-"))
    names = [f"gmn{i + 1}" for i in range(nodes)]
    addresses = {name: f"{SUBNET}.{11 + i}" for i, name in enumerate(names)}
    cluster = Cluster(base, names, addresses)
    try:
        (base / "state").mkdir()
        node_lines = "\n".join(
            f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={cpus} RealMemory=2000 State=UNKNOWN"
            for n, a in addresses.items()
        )
        cluster.conf.write_text(
            SLURM_CONF.format(
                base=base, controller=CONTROLLER_ADDRESS, controller_port=CONTROLLER_PORT, node_port=NODE_PORT,
                min_job_age=min_job_age, nodes=node_lines, node_list=",".join(names),
            )
        )  # fmt: skip
        (base / "cgroup.conf").write_text(CGROUP_CONF)
        _set_hosts({CONTROLLER_ADDRESS: "gmctl", **{a: n for n, a in addresses.items()}})
        cluster.started_munge = _start_munge()
        _network(cluster)
        env = {**os.environ, "SLURM_CONF": str(cluster.conf)}
        cluster.processes.append(
            subprocess.Popen(
                ["unshare", "--uts", "sh", "-c", f"hostname gmctl && exec slurmctld -D -i -f {cluster.conf}"],
                env=env, stdout=subprocess.DEVNULL, stderr=open(base / "slurmctld.err", "wb"), start_new_session=True,
            )
        )  # fmt: skip
        for name in names:
            cluster.processes.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", f"gm-{name}", "unshare", "--uts", "sh", "-c",
                     f"hostname {name} && exec slurmd -D -N {name} -f {cluster.conf}"],
                    env=env, stdout=subprocess.DEVNULL, stderr=open(base / f"slurmd-{name}.err", "wb"),
                    start_new_session=True,
                )
            )  # fmt: skip
        _wait_idle(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_idle(cluster: Cluster, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    states = ""
    while time.monotonic() < deadline:
        for process in cluster.processes:
            if process.poll() is not None:
                raise RuntimeError(f"a Slurm daemon exited ({process.args}): {_tails(cluster)}")
        done = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = done.stdout.strip()
        lines = [line.split() for line in states.splitlines()]
        if len(lines) == len(cluster.nodes) and all(state == "idle" for _, state in lines):
            return
        time.sleep(0.3)
    raise RuntimeError(f"the nodes are not idle after {timeout_s:.0f}s ({states!r}): {_tails(cluster)}")


def _tails(cluster: Cluster) -> str:
    said = []
    for log in sorted(cluster.base.glob("*.log")) + sorted(cluster.base.glob("*.err")):
        lines = log.read_text(errors="replace").splitlines()[-3:]
        if lines:
            said.append(f"{log.name}: " + " | ".join(lines))
    return "; ".join(said)


def _start_munge() -> subprocess.Popen | None:
    """munged, unless one answers already."""
    if subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode == 0:
        return None
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(["munged", "--foreground", "--force"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 10
    while subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode != 0:
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("munged did not start (is /etc/munge/munge.key there?)")
        time.sleep(0.1)
    return process


def _network(cluster: Cluster) -> None:
    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{CONTROLLER_ADDRESS}/24", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    for i, (name, address) in enumerate(cluster.addresses.items()):
        namespace, outside = f"gm-{name}", f"gmveth{i}"
        ip("netns", "add", namespace)
        cluster.namespaces.append(namespace)
        ip("link", "add", outside, "type", "veth", "peer", "name", NODE_INTERFACE, "netns", namespace)
        ip("link", "set", outside, "master", BRIDGE)
        ip("link", "set", outside, "up")
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", NODE_INTERFACE)
        ip("-n", namespace, "link", "set", NODE_INTERFACE, "up")
        ip("-n", namespace, "link", "set", "lo", "up")


def _set_hosts(names: dict[str, str]) -> None:
    """Put ``names`` (address: name) in /etc/hosts, marked, in place of the marked lines of an earlier run."""
    hosts = Path("/etc/hosts")
    kept = [line for line in hosts.read_text().splitlines() if not line.endswith(HOSTS_MARK)]
    added = [f"{address} {name} {HOSTS_MARK}" for address, name in names.items()]
    hosts.write_text("\n".join(kept + added) + "\n")


def _remove_leftovers() -> None:
    """What a cluster of an earlier, killed run left: its daemons, namespaces, links and directories."""
    subprocess.run(["pkill", "-KILL", "-f", "/gpumagic-slurm-"], capture_output=True, check=False)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith("gm-gmn"):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if name.startswith("gmveth") or name == BRIDGE:
            subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
    for old in Path(tempfile.gettempdir()).glob("gpumagic-slurm-*"):
        shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    running = start()
    print(f"export SLURM_CONF={running.conf} GLOO_SOCKET_IFNAME={NODE_INTERFACE}")
    print("nodes:", ", ".join(f"{n} ({a})" for n, a in running.addresses.items()), "- Ctrl-C stops the cluster")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
