"""A userspace link emulator between two test hosts: delay, loss and reordering, where the kernel
has no `sch_netem` (tc's netem qdisc).

Each host gets a TUN device and a /32 route to the other host's address through it, so the two
hosts' traffic to each other (and only that: the proxy reaches them over the bridge) leaves
through the TUN devices. One process holds both devices and carries every IP packet across:
dropped with probability `loss`, delivered `delay_ms` later, and with probability `reorder` held
back `reorder_ms` more, so that packets sent after it overtake it. TCP sees real loss and
reordering (retransmissions, duplicate ACKs), as over a bad link.

    python -m pdserve.testing.linkem NS_A NS_B --delay-ms 50 --loss 0.01 --reorder 0.1
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.testing.netns import Host

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000


def tun_name(host: Host) -> str:
    return f"pdtun{host.ns.rsplit('-', 1)[-1]}"[:15]


@contextmanager
def routed_through_tun(a: Host, b: Host) -> Iterator[None]:
    """Within the block, each host's traffic to the other leaves through its TUN device (while no
    emulator carries it, it is dropped); after it, over the bridge again, the devices removed."""
    for here, there in ((a, b), (b, a)):
        dev = tun_name(here)
        for argv in (["tuntap", "add", "dev", dev, "mode", "tun"], ["link", "set", dev, "up"],
                     ["route", "replace", f"{there.address}/32", "dev", dev]):
            subprocess.run(["ip", "-n", here.ns, *argv], check=True, capture_output=True, text=True)
    try:
        yield
    finally:
        for host in (a, b):  # (its /32 route goes with the device)
            subprocess.run(["ip", "-n", host.ns, "link", "del", tun_name(host)], capture_output=True)


def _open_tun(ns: str, dev: str) -> int:
    """The TUN device `dev` of namespace `ns`, opened from there (a device is looked up by name in
    the opener's namespace); this thread returns to its own namespace after."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    there = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
        return fd
    finally:
        libc.setns(home, CLONE_NEWNET)
        os.close(home)
        os.close(there)


@dataclass
class Impairment:
    delay_ms: float = 0.0
    loss: float = 0.0  # probability a packet is dropped
    reorder: float = 0.0  # probability a packet is held back reorder_ms more than the others
    reorder_ms: float = 10.0

    def args(self) -> list[str]:
        return ["--delay-ms", str(self.delay_ms), "--loss", str(self.loss), "--reorder", str(self.reorder),
                "--reorder-ms", str(self.reorder_ms)]


@dataclass
class LinkStats:
    carried: int = 0
    dropped: int = 0
    held_back: int = 0  # reordered: overtaken by packets sent after them

    def line(self) -> str:
        return f"{self.carried} {self.dropped} {self.held_back}"


def carry(fds: tuple[int, int], impairment: Impairment, rng: random.Random, stats: LinkStats) -> None:
    """Move packets between the two devices until the link is gone, impaired."""
    out = {fds[0]: fds[1], fds[1]: fds[0]}
    queue: list[tuple[float, int, int, bytes]] = []  # (due, sequence, device to write, packet)
    sequence = 0
    while True:
        timeout = max(queue[0][0] - time.monotonic(), 0.0) if queue else None
        readable, _, _ = select.select(list(fds), [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            packet = os.read(fd, 65536)
            if rng.random() < impairment.loss:
                stats.dropped += 1
                continue
            due = now + impairment.delay_ms / 1000
            if rng.random() < impairment.reorder:
                due += impairment.reorder_ms / 1000
                stats.held_back += 1
            heapq.heappush(queue, (due, sequence, out[fd], packet))
            sequence += 1
        while queue and queue[0][0] <= time.monotonic():
            _, _, fd, packet = heapq.heappop(queue)
            try:
                os.write(fd, packet)
            except OSError:  # the device went (its namespace deleted): the link is gone
                return
            stats.carried += 1


class LinkEmulator:
    """The emulator process for two hosts' link, while in the `with` block."""

    def __init__(self, a: Host, b: Host, impairment: Impairment, seed: int = 0) -> None:
        self.a, self.b, self.impairment, self.seed = a, b, impairment, seed
        self.proc: subprocess.Popen | None = None
        self.stats: LinkStats | None = None  # what it did, once it has stopped

    def __enter__(self) -> LinkEmulator:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.testing.linkem", self.a.ns, self.b.ns,
                                      *self.impairment.args(), "--seed", str(self.seed)],
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.wait(5)
            raise RuntimeError(f"the link emulator did not start (status {self.proc.returncode})")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        counts = self.proc.stdout.read().split()
        self.proc.wait(10)
        self.stats = LinkStats(*map(int, counts[-3:])) if len(counts) >= 3 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ns_a")
    parser.add_argument("ns_b")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--reorder", type=float, default=0.0)
    parser.add_argument("--reorder-ms", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    a, b = Host(args.ns_a, ""), Host(args.ns_b, "")
    fds = (_open_tun(a.ns, tun_name(a)), _open_tun(b.ns, tun_name(b)))
    stats = LinkStats()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    try:
        carry(fds, Impairment(args.delay_ms, args.loss, args.reorder, args.reorder_ms), random.Random(args.seed), stats)
    finally:
        print(stats.line(), flush=True)


if __name__ == "__main__":
    main()
