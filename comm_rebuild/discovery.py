"""Where am I, and where is the master? Address discovery for a (restored) rank.

Sources, in order of precedence:

1. the restore-metadata file the agent/controller writes when it restores a
   pod: JSON ``{"generation", "master_addr", "port_base", "rank_map": {rank: addr}}``;
2. the environment Kubernetes' downward API provides: ``POD_IP``,
   ``MASTER_ADDR``, ``MASTER_PORT`` (and the ``--master`` flag, which sets the same);
3. the network interfaces: the local address that routes to the master.

Each source is a small function that returns what it knows (``None`` for
what it does not), so each can be tested alone; ``discover`` merges them.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from podsnap.errors import PodsnapError

SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class RestoreMetadata:
    generation: int
    master_addr: str
    port_base: int
    rank_map: dict[int, str]

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "master_addr": self.master_addr,
                           "port_base": self.port_base, "rank_map": {str(k): v for k, v in self.rank_map.items()}})

    def write(self, path: str | Path) -> None:
        """Replace ``path`` atomically (a rank polling it never reads half a file)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(self.to_json())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)


@dataclass(frozen=True)
class Addresses:
    own_addr: str
    master_addr: str
    port_base: int
    generation: int
    sources: dict[str, str]  # field -> where it came from


def from_metadata_file(path: str | Path | None) -> RestoreMetadata | None:
    if not path or not Path(path).exists():
        return None
    try:
        d = json.loads(Path(path).read_text())
        return RestoreMetadata(int(d["generation"]), str(d["master_addr"]), int(d["port_base"]),
                               {int(k): str(v) for k, v in d.get("rank_map", {}).items()})
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise PodsnapError(f"restore metadata {path} is not valid ({type(e).__name__}: {e}); expected JSON with "
                           "generation, master_addr, port_base and rank_map") from None


def from_environment(env=os.environ) -> dict[str, str | int]:
    out: dict[str, str | int] = {}
    if env.get("POD_IP"):
        out["own_addr"] = env["POD_IP"]
    if env.get("MASTER_ADDR"):
        out["master_addr"] = env["MASTER_ADDR"]
    if env.get("MASTER_PORT"):
        if not env["MASTER_PORT"].isdigit():
            raise PodsnapError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number")
        out["port_base"] = int(env["MASTER_PORT"])
    return out


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one (ioctl SIOCGIFADDR)."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            out[name] = socket.inet_ntoa(raw[20:24])
    return out


def from_interfaces(master_addr: str | None = None) -> str | None:
    """The local address that routes to ``master_addr`` (a UDP connect sends nothing), else the
    first non-loopback interface address."""
    if master_addr:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master_addr, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    addrs = [a for a in interface_addresses().values() if not ipaddress.ip_address(a).is_loopback]
    return addrs[0] if addrs else None


def interface_for(addr: str) -> str | None:
    """Name of the interface holding ``addr`` (for GLOO_SOCKET_IFNAME)."""
    return next((name for name, a in interface_addresses().items() if a == addr), None)


def discover(rank: int, metadata_path: str | Path | None = None, master: str | None = None,
             env=os.environ) -> Addresses:
    """Merge the sources; ``master`` is the ``--master HOST:PORT`` flag (same rank as the environment)."""
    meta = from_metadata_file(metadata_path)
    envd = from_environment(env)
    if master:
        from .groups import parse_master

        host, port = parse_master(master)
        envd = {**envd, "master_addr": host, "port_base": port}
    fields, sources = {}, {}
    if meta:
        fields.update(master_addr=meta.master_addr, port_base=meta.port_base, generation=meta.generation)
        sources.update(master_addr="metadata", port_base="metadata", generation="metadata")
        if rank in meta.rank_map:
            fields["own_addr"], sources["own_addr"] = meta.rank_map[rank], "metadata"
    for key, value in envd.items():
        if key not in fields:
            fields[key], sources[key] = value, "environment"
    if "master_addr" not in fields or "port_base" not in fields:
        raise PodsnapError(f"rank {rank}: no master address: give --master HOST:PORT, set MASTER_ADDR and "
                           "MASTER_PORT, or pass --restore-metadata FILE")
    if "own_addr" not in fields:
        own = from_interfaces(fields["master_addr"])
        if own is None:
            raise PodsnapError(f"rank {rank}: cannot find a local address; set POD_IP")
        fields["own_addr"], sources["own_addr"] = own, "interfaces"
    fields.setdefault("generation", 0)
    sources.setdefault("generation", "default")
    return Addresses(fields["own_addr"], fields["master_addr"], int(fields["port_base"]), int(fields["generation"]),
                     sources)
