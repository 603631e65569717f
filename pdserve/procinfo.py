"""What /proc says about a process: its RSS, its children, whether it still runs; and the shared
memory a dead one left (Linux only)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SHM_DIR = Path("/dev/shm")
POOL_PREFIX = "pdserve-kv-"  # + the creator's pid + "-" + a random part (kv/pool.py names them)


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state follows "(command name)"


def pool_name(pid: int, tag: str) -> str:
    """A shared KV pool's name: its creator's pid in it, so that a pool whose creator died (killed:
    no chance to unlink it) can be told apart and removed."""
    return f"{POOL_PREFIX}{pid}-{tag}"


def remove_dead_pools() -> list[str]:
    """Unlink the shared KV pools whose creator no longer runs; their names."""
    removed = []
    for path in SHM_DIR.glob(f"{POOL_PREFIX}*") if SHM_DIR.is_dir() else ():
        match = re.fullmatch(rf"{POOL_PREFIX}(\d+)-\w+", path.name)
        if match and not alive(int(match.group(1))):
            try:
                os.unlink(path)
                removed.append(path.name)
            except FileNotFoundError:  # another process removed it first
                pass
    return removed


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time the process has used so far (its own threads, not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def descendants(pid: int) -> list[int]:
    """Every process below pid (children, their children, ...)."""
    out, todo = [], children(pid)
    while todo:
        out.append(todo.pop())
        todo += children(out[-1])
    return out


def command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
