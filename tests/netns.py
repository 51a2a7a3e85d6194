"""Pods on one machine: network namespaces with veth pairs on a bridge, one IP each.

Created and deleted by the test (root needed). In CI (CI=true) a failure to
create namespaces fails the test; elsewhere it skips with the reason printed.
Processes run inside a pod through ``nsenter --net`` (``ip netns exec`` adds a
mount namespace that CRIU cannot dump).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@dataclass
class NetPod:
    name: str
    netns: str
    ip: str

    def cmd(self, *args: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", *args]


class PodNetwork:
    def __init__(self):
        self.tag = os.urandom(2).hex()
        self.subnet = f"10.242.{int(self.tag, 16) % 200 + 20}"
        self.bridge = f"psbr{self.tag}"
        self.pods: list[NetPod] = []
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def add(self, name: str) -> NetPod:
        pod = NetPod(name, f"ps{self.tag}{name}", f"{self.subnet}.{len(self.pods) + 10}")
        host_end = f"v{self.tag}{len(self.pods)}"
        sh("ip", "netns", "add", pod.netns)
        self.pods.append(pod)
        sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", pod.netns)
        sh("ip", "link", "set", host_end, "master", self.bridge, "up")
        sh("ip", "-n", pod.netns, "addr", "add", f"{pod.ip}/24", "dev", "eth0")
        sh("ip", "-n", pod.netns, "link", "set", "eth0", "up")
        sh("ip", "-n", pod.netns, "link", "set", "lo", "up")
        return pod

    def close(self) -> None:
        for pod in self.pods:
            subprocess.run(["ip", "netns", "del", pod.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
