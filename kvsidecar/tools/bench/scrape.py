"""What ``kvsidecar bench`` reads from the sidecars themselves: their /metrics histograms (mean
post duration and mean per Read phase between two scrapes) and their CPU time; and the latency
samples the control-plane pass collects."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsidecar.client.requests import target_for
from kvsidecar.testing.cluster import Rank

_POST_METRIC = "kvsidecar_read_post_duration_seconds"


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True, kw_only=True)
class Latency:
    """Control-plane samples, seconds: client-side Read call durations, Read call to RECV_DONE,
    event delivery (client receive minus sidecar emit), Status round trips (the sidecar builds
    its whole status: not a no-op), gRPC health Check round trips on the same socket (the
    gRPC floor), raw NIXL
    post -> DONE of the same one-block requests, and the decode sidecars' mean server-side
    durations over the same Reads: the post (``kvsidecar_read_post_duration_seconds``) and
    each phase (``kvsidecar_read_phase_seconds``)."""

    read_posted_s: tuple[float, ...]
    read_done_s: tuple[float, ...]  # Read call -> its RECV_DONE received here
    done_to_event_s: tuple[float, ...]
    status_rtt_s: tuple[float, ...]
    health_rtt_s: tuple[float, ...]
    nixl_s: tuple[float, ...]  # raw NIXL: post -> DONE (and release) of the same request
    server_post_mean_s: float | None
    server_phase_mean_s: dict[str, float]


_PHASE_METRIC = "kvsidecar_read_phase_seconds"


async def scrape(rank: Rank) -> dict[str, float]:
    """``scrape_metrics`` of ``rank``'s sidecar."""
    return await scrape_metrics(rank.addresses["metrics"])


async def scrape_metrics(address: str) -> dict[str, float]:
    """``_sum``/``_count`` samples of the post-duration and per-phase histograms of the /metrics
    of the sidecar at ``address`` (host:port), keyed ``post_duration_sum``,
    ``post_duration_count``, ``<phase>_sum``, ``<phase>_count``."""

    def fetch() -> str:
        url = f"http://{address}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text: str = resp.read().decode()
        return text

    values: dict[str, float] = {}
    for line in (await asyncio.to_thread(fetch)).splitlines():
        name, _, value = line.rpartition(" ")
        for suffix in ("_sum", "_count"):
            if name == _POST_METRIC + suffix:
                values["post_duration" + suffix] = float(value)
            elif name.startswith(_PHASE_METRIC + suffix + '{phase="'):
                phase = name[len(_PHASE_METRIC + suffix + '{phase="') : -2]
                values[phase + suffix] = float(value)
    return values


async def health_rtts(engine_socket: str, samples: int) -> tuple[float, ...]:
    """``samples`` sequential gRPC health Checks on the sidecar's engine socket, seconds each: the
    round trip of a call whose handler does nothing (a warm-up call first, untimed)."""
    async with grpc.aio.insecure_channel(target_for(engine_socket)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        await stub.Check(request, timeout=10)
        out = []
        for _ in range(samples):
            start = time.perf_counter()
            await stub.Check(request, timeout=10)
            out.append(time.perf_counter() - start)
    return tuple(out)


def means(
    before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]
) -> dict[str, float]:
    """Mean seconds per histogram between two scrapes of every rank (``post_duration`` and each
    phase)."""
    out = {}
    for key in after[0]:
        if not key.endswith("_sum"):
            continue
        name = key[: -len("_sum")]
        total = sum(a.get(key, 0.0) - b.get(key, 0.0) for a, b in zip(after, before, strict=True))
        count = sum(
            a.get(name + "_count", 0.0) - b.get(name + "_count", 0.0)
            for a, b in zip(after, before, strict=True)
        )
        if count:
            out[name] = total / count
    return out
