"""A Redis as production runs it, on loopback: one master, one replica and three sentinels, all from
the same `redis-server` binary (the tests' one: harness.procs.redis_server_binary).

    ha = SentinelRedis(tmp_path / "ha", ProcessSet(tmp_path / "logs"))
    url = ha.start()                  # redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/mymaster/0
    old = ha.kill_master()            # kill -9 the master; returns its name ("redis-a" or "redis-b")
    new = ha.wait_failover(old)       # the sentinels promoted the other one, and it says it is master
    ha.restart(old)                   # the old master comes back; the sentinels make it a replica
    ha.wait_replica_of(old, new)
    ha.stop()

Each instance runs in its own session with a config file of its own in `root/<name>/` (the sentinels
rewrite theirs; a master turned replica rewrites its own), on free ports; `stop` (or the ProcessSet's
owner) ends them. The failover is fast on purpose: the sentinels call a master down after
`down_after` ms (1000) without an answer, where production sets seconds (docs/store.md).

`python -m harness.sentinel [--password PW] [--dir DIR]` runs one for a trial, prints its URL,
and stops it on Ctrl-C (docs/store.md, "A local HA stack").
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import redis

from harness.procs import Proc, ProcessSet, free_port, redis_server_binary, socket_inodes, wait_until

if TYPE_CHECKING:
    from harness.cluster import RedisTLS

MASTER_NAME = "mymaster"
DATA = ("redis-a", "redis-b")  # redis-a starts as the master, redis-b as its replica
SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")


@dataclass
class Instance:
    name: str
    port: int
    conf: Path
    argv: list[str]
    proc: Proc | None = None


class SentinelRedis:
    def __init__(self, root: Path, procs: ProcessSet, password: str | None = None, persistent: bool = True,
                 down_after: int = 1000, failover_timeout: int = 5000, binary: str | None = None,
                 tls: "RedisTLS | None" = None):
        """`tls`: every instance (sentinels included) serves TLS only, with these certificates, and
        replicates over TLS; the URL is then `rediss+sentinel://...?ssl_ca_certs=CA`."""
        self.root, self.procs, self.password, self.tls = Path(root), procs, password, tls
        self.persistent, self.down_after, self.failover_timeout = persistent, down_after, failover_timeout
        self.binary = binary or redis_server_binary()
        self.instances: dict[str, Instance] = {}

    # --- addresses ---------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"127.0.0.1:{self.instances[s].port}" for s in SENTINELS)
        if self.tls:
            return f"rediss+sentinel://{auth}{hosts}/{MASTER_NAME}/0?ssl_ca_certs={quote(str(self.tls.ca))}"
        return f"redis+sentinel://{auth}{hosts}/{MASTER_NAME}/0"

    def port(self, name: str) -> int:
        return self.instances[name].port

    def name_at(self, port: int) -> str:
        return next(n for n, i in self.instances.items() if i.port == port)

    def client(self, name: str, **kw) -> redis.Redis:
        """A plain client of one instance (data or sentinel), for the test's own looks."""
        auth = {"password": self.password} if self.password and name in DATA else {}
        if self.tls:
            auth.update(ssl=True, ssl_ca_certs=str(self.tls.ca), ssl_cert_reqs="required")
        return redis.Redis("127.0.0.1", self.port(name), decode_responses=True, socket_timeout=2,
                           socket_connect_timeout=1, **auth, **kw)

    def sentinel_master(self, sentinel: str = SENTINELS[0]) -> str | None:
        """The data instance `sentinel` names as the master now (None while it names none)."""
        with self.client(sentinel) as s:
            addr = s.execute_command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
        return self.name_at(int(addr[1])) if addr else None

    def master(self) -> str:
        """The master every sentinel agrees on."""
        named = {self.sentinel_master(s) for s in SENTINELS}
        assert len(named) == 1 and None not in named, f"the sentinels disagree on the master: {named}"
        return named.pop()

    def role(self, name: str) -> str:
        with self.client(name) as c:
            return c.execute_command("ROLE")[0]

    # --- processes ---------------------------------------------------------------------------------
    def start(self) -> str:
        """Start the five processes; returns the Sentinel URL once the sentinels know each other, the
        master and its replica, and the replica is in sync."""
        for name in (*DATA, *SENTINELS):
            self.instances[name] = Instance(name, free_port(), self.root / name / f"{name}.conf", [])
        master = self.instances[DATA[0]]
        for name in DATA:
            self._write_data_conf(self.instances[name], None if name == DATA[0] else master.port)
        replica = self.instances[DATA[1]]
        for name in SENTINELS:
            self._write_sentinel_conf(self.instances[name], master.port, replica.port)
        for name in (*DATA, *SENTINELS):
            self._spawn(name)
        wait_until(self._settled, 30, interval=0.1, what="the sentinels to see the master, its replica and each other")
        return self.url

    def _write_data_conf(self, inst: Instance, replica_of: int | None) -> None:
        inst.conf.parent.mkdir(parents=True, exist_ok=True)
        lines = [*self._listen(inst), "bind 127.0.0.1", f"dir {inst.conf.parent}", 'save ""',
                 f"appendonly {'yes' if self.persistent else 'no'}", "appendfsync everysec"]
        if self.password:
            lines += [f"requirepass {_quoted(self.password)}", f"masterauth {_quoted(self.password)}"]
        if replica_of is not None:
            lines.append(f"replicaof 127.0.0.1 {replica_of}")
        inst.conf.write_text("\n".join(lines) + "\n")
        inst.argv = [self.binary, str(inst.conf)]

    def _write_sentinel_conf(self, inst: Instance, master_port: int, replica_port: int) -> None:
        # Each sentinel is told its peers and the replica up front (what they would otherwise learn
        # from hello messages and the master's INFO within ~10 s), so the stack is ready in a second.
        inst.conf.parent.mkdir(parents=True, exist_ok=True)
        lines = [*self._listen(inst), "bind 127.0.0.1", f"dir {inst.conf.parent}", f"sentinel myid {_myid(inst.name)}",
                 f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2",
                 f"sentinel known-replica {MASTER_NAME} 127.0.0.1 {replica_port}",
                 *(f"sentinel known-sentinel {MASTER_NAME} 127.0.0.1 {self.instances[p].port} {_myid(p)}"
                   for p in SENTINELS if p != inst.name),
                 f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after}",
                 f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout}",
                 f"sentinel parallel-syncs {MASTER_NAME} 1"]
        if self.password:
            lines.append(f"sentinel auth-pass {MASTER_NAME} {_quoted(self.password)}")
        inst.conf.write_text("\n".join(lines) + "\n")
        inst.argv = [self.binary, str(inst.conf), "--sentinel"]

    def _listen(self, inst: Instance) -> list[str]:
        """The port lines: plain, or TLS only (the plain port closed, so a client without TLS fails)."""
        if not self.tls:
            return [f"port {inst.port}"]
        t = self.tls
        return ["port 0", f"tls-port {inst.port}", f"tls-cert-file {t.cert}", f"tls-key-file {t.key}",
                f"tls-ca-cert-file {t.ca}", "tls-auth-clients no", "tls-replication yes"]

    def _spawn(self, name: str) -> Proc:
        inst = self.instances[name]
        inst.proc = self.procs.start(name, inst.argv)
        return inst.proc

    def _settled(self) -> bool:
        for s in SENTINELS:
            with self.client(s) as c:
                m = c.execute_command("SENTINEL", "master", MASTER_NAME)
            info = dict(zip(m[::2], m[1::2])) if isinstance(m, list) else m
            if int(info["num-slaves"]) < 1 or int(info["num-other-sentinels"]) < 2 or "s_down" in info["flags"]:
                return False
            with self.client(s) as c:
                replicas = c.sentinel_slaves(MASTER_NAME)
            # The sentinel has read the replica's INFO (a failover needs it): its link to the master is up.
            if not any(r.get("master-link-status") == "ok" and not r["is_sdown"] and not r["is_disconnected"]
                       for r in replicas):
                return False
        replica = next(n for n in DATA if n != self.master())
        return self.link_up(replica)

    def link_up(self, name: str) -> bool:
        with self.client(name) as c:
            return c.info("replication").get("master_link_status") == "up"

    def cut_replication(self, replica: str) -> None:
        """The master's writes stop reaching `replica` (which stays up, and eligible for promotion): its
        link is dropped, and its next attempts fail to authenticate. Needs a password. (Freezing the
        replica would not do: the kernel keeps buffering the stream, and a thawed replica applies it.)"""
        assert self.password, "cut_replication needs a stack with a password"
        with self.client(replica) as c:
            c.config_set("masterauth", "not-" + self.password)
        with self.client(self.master()) as m:
            m.execute_command("CLIENT", "KILL", "TYPE", "replica")
        wait_until(lambda: not self.link_up(replica), 10, what=f"{replica}'s link to go down")

    def mend_replication(self, replica: str) -> None:
        """Undo cut_replication (its config again has the right password)."""
        with self.client(replica) as c:
            c.config_set("masterauth", self.password)

    def kill(self, name: str) -> None:
        """kill -9 one instance (nothing flushed)."""
        self.instances[name].proc.kill9()

    def kill_master(self) -> str:
        """kill -9 the master; returns its name."""
        name = self.master()
        self.kill(name)
        return name

    def wait_failover(self, old: str, timeout: float = 30) -> str:
        """Wait until every sentinel names another master than `old` and that one says it is master."""
        def promoted() -> str | None:
            named = {self.sentinel_master(s) for s in SENTINELS}
            if len(named) != 1 or old in named or None in named:
                return None
            new = named.pop()
            return new if self.role(new) == "master" else None

        return wait_until(promoted, timeout, interval=0.05, what=f"a failover away from {old}")

    def restart(self, name: str) -> Proc:
        """Start a killed instance again with its config file (what the sentinels rewrote into it)."""
        return self._spawn(name)

    def wait_replica_of(self, name: str, master: str, timeout: float = 30) -> None:
        """Wait until `name` replicates `master`, is in sync, and has finished rewriting its append-only
        file after the sync (a redis-server 6.2 writing its first AOF ignores SIGTERM)."""
        def following() -> bool:
            with self.client(name) as c:
                info = c.info("replication")
                busy = c.info("persistence").get("aof_rewrite_in_progress")
            return (info.get("role") == "slave" and int(info.get("master_port", 0)) == self.port(master)
                    and info.get("master_link_status") == "up" and not busy)

        wait_until(following, timeout, interval=0.1, what=f"{name} to replicate {master}")

    def clients(self, name: str) -> list[dict[str, str]]:
        """`CLIENT LIST` of one data instance, less the replication links, the sentinels' connections
        and this call's own: who else is connected."""
        with self.client(name) as c:
            me = c.client_id()
            rows = c.client_list()
        return [r for r in rows if int(r["id"]) != me and not set(r.get("flags", "")) & {"S", "M"}
                and not r.get("name", "").startswith("sentinel-")]

    def talkers(self, name: str) -> list[str]:
        """`clients(name)`, each with the process that holds its socket (found in /proc, not named by
        anyone): `127.0.0.1:40112 pid 1234 (celery -A workers worker ...)`."""
        return [f"{c['addr']} {owner(c['addr'])}" for c in self.clients(name)]

    def stop(self) -> None:
        for name in (*SENTINELS, *DATA):
            inst = self.instances.get(name)
            if inst and inst.proc:
                inst.proc.stop()


def owner(addr: str) -> str:
    """The process holding the local TCP socket `host:port` (a Redis client's address as CLIENT LIST
    shows it): its pid and command line, from /proc/net/tcp's inode and each process's fds."""
    port = int(addr.rsplit(":", 1)[1])
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if int(cols[1].split(":")[1], 16) == port:
                inode = cols[9]
                break
    if inode is None:
        return "(socket gone)"
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if inode in socket_inodes(pid):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {pid} ({cmd[:120]})"
        except OSError:
            continue
    return "(no process found)"


def _quoted(value: str) -> str:
    """A value for a Redis config file: in double quotes, its quotes and backslashes escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _myid(name: str) -> str:
    """A sentinel's fixed 40-hex-digit id (its peers are told it in their config files)."""
    return hashlib.sha1(name.encode()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    import argparse
    import signal
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m harness.sentinel",
                                     description="one master, one replica and three sentinels on loopback")
    parser.add_argument("--password", default=None)
    parser.add_argument("--dir", default=None, help="data and logs (default: a new temporary directory)")
    parser.add_argument("--down-after", type=int, default=1000, help="ms without an answer before a failover")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="llmgw-sentinel-")).absolute()
    ha = SentinelRedis(root, ProcessSet(root / "logs"), password=args.password, down_after=args.down_after)
    try:
        url = ha.start()
        print(f"master {ha.master()} on 127.0.0.1:{ha.port(ha.master())}; data and logs in {root}")
        print(f"export LLMGW_REDIS_URL='{url}'", flush=True)
        print("Ctrl-C stops it", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        ha.stop()


if __name__ == "__main__":
    import signal as _signal

    _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})
    main()
