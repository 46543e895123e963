"""A network that can be partitioned: packets dropped silently, not refused.

A network namespace joined to this one by a veth pair; a socket made to listen inside it is
reached from here through the pair. ``cut()`` takes the far end's link down: every packet
either way is then lost without a word (no reset, no refusal), what a failover that moves an
address or a firewall change does; ``heal()`` brings it back. Needs root (``ip netns``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import threading

CLONE_NEWNET = 0x40000000


class Partition:
    def __init__(self) -> None:
        self.name = f"thp{os.getpid()}"
        octet = os.getpid() % 250 + 1
        self.near, self.far = f"10.213.{octet}.1", f"10.213.{octet}.2"
        self.close()  # what a killed run of this process's number may have left
        self._ip("netns", "add", self.name)
        try:
            self._ip("link", "add", f"{self.name}a", "type", "veth", "peer", "name", self._far_link)
            self._ip("link", "set", self._far_link, "netns", self.name)
            self._ip("addr", "add", f"{self.near}/30", "dev", f"{self.name}a")
            self._ip("link", "set", f"{self.name}a", "up")
            self._ip("-n", self.name, "addr", "add", f"{self.far}/30", "dev", self._far_link)
            self._ip("-n", self.name, "link", "set", "lo", "up")
            # The far end's address stays known (as a gateway's is): packets to it are sent
            # and lost, rather than refused at once for want of an answer to ARP.
            far_mac = self._far_mac()
            self._ip(
                "neigh", "replace", self.far, "lladdr", far_mac, "dev", f"{self.name}a",
                "nud", "permanent",
            )  # fmt: skip
            self.heal()
        except BaseException:
            self.close()
            raise

    @property
    def _far_link(self) -> str:
        return f"{self.name}b"

    def _far_mac(self) -> str:
        shown = subprocess.run(
            ["ip", "-n", self.name, "-o", "link", "show", self._far_link],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return shown.split("link/ether", 1)[1].split()[0]

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def listen(self) -> socket.socket:
        """A listening socket at the far end (any free port)."""
        made: list[socket.socket | BaseException] = []

        def make() -> None:  # in a thread of its own: setns moves only the calling thread
            libc = ctypes.CDLL(None, use_errno=True)
            here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            there = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
            try:
                if libc.setns(there, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns into the far namespace")
                try:
                    made.append(socket.create_server((self.far, 0)))
                finally:
                    if libc.setns(here, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns back")
            except BaseException as exc:
                made.append(exc)
            finally:
                os.close(here)
                os.close(there)

        thread = threading.Thread(target=make)
        thread.start()
        thread.join()
        if isinstance(made[0], BaseException):
            raise made[0]
        return made[0]

    def cut(self) -> None:
        self._ip("-n", self.name, "link", "set", self._far_link, "down")

    def heal(self) -> None:
        self._ip("-n", self.name, "link", "set", self._far_link, "up")

    def close(self) -> None:
        for args in (("netns", "del", self.name), ("link", "del", f"{self.name}a")):
            with contextlib.suppress(subprocess.CalledProcessError):
                self._ip(*args)
