"""The agent's Prometheus metrics, served on their own port (``--metrics-port``), in a registry of their own."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class AgentMetrics:
    registry: CollectorRegistry
    checkpoints: Counter
    restores: Counter
    checkpoint_seconds: Histogram
    restore_seconds: Histogram
    archive_bytes: Counter
    snapshot_bytes_written: Counter
    snapshot_bytes_deduplicated: Counter
    refused_connections: Counter

    @classmethod
    def create(cls) -> AgentMetrics:
        r = CollectorRegistry()
        return cls(
            r,
            Counter("podsnap_agent_checkpoints", "Checkpoint requests by kind and result", ["kind", "result"],
                    registry=r),
            Counter("podsnap_agent_restores", "Restore requests by result", ["result"], registry=r),
            Histogram("podsnap_agent_checkpoint_seconds", "Duration of checkpoint requests", ["kind"],
                      buckets=DURATION_BUCKETS, registry=r),
            Histogram("podsnap_agent_restore_seconds", "Duration of restore requests", buckets=DURATION_BUCKETS,
                      registry=r),
            Counter("podsnap_agent_archive_bytes", "Bytes of checkpoint archives written", registry=r),
            Counter("podsnap_agent_snapshot_bytes_written", "Bytes the engines wrote to the store when pausing",
                    registry=r),
            Counter("podsnap_agent_snapshot_bytes_deduplicated",
                    "Bytes of engine state already in the store (not written again)", registry=r),
            Counter("podsnap_agent_refused_connections", "Connections refused by the SO_PEERCRED check",
                    registry=r),
        )

    def totals(self) -> dict[str, int]:
        """The counters as Status reports them: checkpoints and restores by result, refused connections."""
        out: dict[str, int] = {}
        for metric, prefix in ((self.checkpoints, "checkpoints_"), (self.restores, "restores_"),
                               (self.refused_connections, "refused_connections")):
            for sample in metric.collect()[0].samples:
                if sample.name.endswith("_total") and sample.value:
                    key = prefix + sample.labels.get("result", "")
                    out[key] = out.get(key, 0) + int(sample.value)
        return out

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Start the /metrics HTTP server; returns it (``shutdown()`` stops it)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
