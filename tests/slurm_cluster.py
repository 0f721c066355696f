"""A real SLURM cluster on this machine for the tests: munged, slurmctld and two slurmd (nodes n1 and n2 of partition
`debug`, both at 127.0.0.1), every file of theirs in one temporary folder, started from a generated slurm.conf and
stopped by pid. Debian's packages: `apt-get install --no-install-recommends slurm-wlm`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")
NODES = ("n1", "n2")
INSTALL = "apt-get install --no-install-recommends slurm-wlm"


def _path() -> str:
    """PATH and the daemons' folders (Debian puts slurmctld, slurmd and munged in /usr/sbin, which a PATH may lack)."""
    return ":".join(filter(None, [os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def missing() -> str | None:
    """Why a real cluster cannot start here (one line naming what to install), or None."""
    absent = [tool for tool in DAEMONS if shutil.which(tool, path=_path()) is None]
    if absent:
        return f"a real SLURM cluster needs {', '.join(absent)}: install them with `{INSTALL}`"
    if os.geteuid() != 0:
        return "a real SLURM cluster needs root (slurmd starts every user's job steps): run these tests as root"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def slurm_conf(folder: Path, ports: list[int], cred_expire: int = 5) -> str:
    """A slurm.conf for one controller and nodes n1, n2 on 127.0.0.1, each on a port of its own: no cgroups, no
    accounting, every state, spool, pid and log file in `folder`, a job requeued within seconds (`cred_expire`)."""
    controller, *node_ports = ports
    nodes = [
        f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory=4000 State=UNKNOWN"
        for name, port in zip(NODES, node_ports)
    ]
    return "\n".join(
        [
            "ClusterName=launchtest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={controller}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={folder / 'munge' / 'munge.sock'},cred_expire={cred_expire}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "MpiDefault=none",
            "SchedulerParameters=sched_interval=1",
            "KillWait=30",  # the job's save on SIGTERM, on a busy machine
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}/%n",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd'}.%n.pid",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd'}.%n.log",
            *nodes,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


class Cluster:
    """The daemons of one local cluster; `env` is what a client (sbatch, srun, scontrol, launch) needs to reach it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": _path()}  # the daemons found where looked for

    def start(self) -> Cluster:
        folder = self.folder
        for sub in ("state", "munge", *(f"spool/{n}" for n in NODES)):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(slurm_conf(folder, _free_ports(1 + len(NODES))))
        key = folder / "munge.key"
        subprocess.run(["/usr/sbin/mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        # --force: as root, with the socket in a folder under the test's private (0700) temporary folders
        self._daemon(
            [
                "/usr/sbin/munged",
                "--foreground",
                "--force",
                f"--socket={folder / 'munge' / 'munge.sock'}",
                f"--key-file={key}",
                f"--log-file={folder / 'munged.log'}",
                f"--pid-file={folder / 'munged.pid'}",
                f"--seed-file={folder / 'munged.seed'}",
            ],
            "munged",
        )
        self._wait(lambda: (folder / "munge" / "munge.sock").exists(), "munged's socket")
        self._daemon(["slurmctld", "-D", "-i"], "slurmctld")
        for node in NODES:
            self._daemon(["slurmd", "-D", "-N", node], f"slurmd.{node}")
        self._wait(self.idle, "both nodes idle")
        return self

    def _daemon(self, argv: list[str], name: str) -> None:
        log = open(self.folder / f"{name}.out", "wb")  # noqa: SIM115 (the daemon's, closed with it)
        self.daemons.append(
            subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        log.close()

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} ended before {what}: see {self.folder}/*.out and *.log")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"no {what} within {timeout} s: see {self.folder}/*.out and *.log")

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A SLURM client command against this cluster."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return out.returncode == 0 and all(states.get(n) == "idle" for n in NODES)

    def jobs(self) -> list[str]:
        """The ids of the jobs the controller still knows as pending or running (requeued ones included)."""
        out = self.run("squeue", "-h", "-o", "%A", check=False)
        return out.stdout.split()

    def wait_jobs_gone(self, timeout: float = 120) -> None:
        self._wait(lambda: not self.jobs() and not self.steps(), "job left", timeout)

    def steps(self) -> list[int]:
        """Pids of the slurmstepd processes of this cluster's nodes (they outlive slurmd; each holds its node's
        spool folder open)."""
        return list(_stepds(self.folder))

    def clear(self) -> None:
        """Cancel every job and wait until none is left on either node, nor any of its steps."""
        if self.jobs():
            self.run("scancel", "--full", "--user=root", check=False)
            self.run("scancel", "--user=root", check=False)
        self.wait_jobs_gone()

    def stop(self) -> None:
        """Cancel what runs, then end each daemon by its pid (SIGTERM, then SIGKILL), and any step left over."""
        try:
            if all(d.poll() is None for d in self.daemons):
                self.clear()
        except RuntimeError:
            pass
        for daemon in reversed(self.daemons):  # the nodes first, the controller, munged last
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        for pid in _stepds(self.folder):  # a step of a job the controller forgot
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stepds(folder: Path) -> Iterator[int]:
    spool = str(folder / "spool")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not (proc / "comm").read_text().startswith("slurmstepd"):
                continue
            if any(os.readlink(fd).startswith(spool) for fd in (proc / "fd").iterdir()):
                yield int(proc.name)
        except OSError:
            continue


if __name__ == "__main__":  # a cluster to try jobs on by hand: python tests/slurm_cluster.py FOLDER (as root)
    import sys

    if why := missing():
        sys.exit(why)
    cluster = Cluster(Path(sys.argv[1]).absolute()).start()
    print(f"nodes n1 and n2 idle in partition debug; in another shell: export SLURM_CONF={cluster.conf}", flush=True)
    print("Ctrl-C cancels every job and stops the daemons", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
