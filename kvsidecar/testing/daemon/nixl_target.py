"""A NIXL target process for the backend contract suite and ``bench_backend`` (the child side;
``kvsidecar.testing.daemon.target_process`` starts it and talks to it).

Usage: ``python -m kvsidecar.testing.daemon.nixl_target SHM_PATH SIZE [POLL_DELAY_US]`` imports ``SHM_PATH``
as host_shm memory; ``... cuda_ipc HANDLE_HEX DEVICE_UUID OFFSET SIZE`` imports CUDA IPC memory;
``... own KIND SIZE SEED`` allocates ``SIZE`` bytes itself (``testing.gpu.MemoryKind``: ``cupy`` is
cudaMalloc on device 0, ``host`` a /dev/shm file it unlinks on exit) and fills them with
``testing.gpu.fill_pattern(SEED)``. It
registers the memory and prints one JSON line ``{"ready": {"metadata": hex, "base": int, "name": str}}``.
Then prints ``{"notif": {"agent": str, "payload": hex}}`` for every notification received. Reads
JSON commands on stdin: ``{"add": hex}`` loads a remote agent; ``{"notify": {"agent": name,
"payload": hex, "times": n}}`` sends it a notification n times; ``{"echo": true}`` sends every later
notification back to its sender (which must have been added); ``{"echo": false}`` stops. Exits when
stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Callable
from typing import Protocol

from kvsidecar.engine.backend import RemoteAgent
from kvsidecar.engine.backend.nixl import NixlBackend
from kvsidecar.memory import CudaIpcSpec, HostShmSpec, MemoryRegion, import_memory
from kvsidecar.testing.gpu import EngineBuffer, MemoryKind, fill_pattern, shm_path


def _emit(doc: object) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


class _Memory(MemoryRegion, Protocol):
    """Memory this process serves: imported, or its own; ``close()`` releases it."""

    def close(self) -> None: ...


def own_memory(kind: MemoryKind, size: int, seed: int) -> EngineBuffer:
    """``size`` bytes this process allocates itself, filled with ``fill_pattern(seed)``."""
    buf = EngineBuffer.allocate(kind, size, shm_path=shm_path("target"))
    try:
        fill_pattern(buf, seed)
    except BaseException:
        buf.close()
        raise
    return buf


async def main(open_memory: Callable[[], _Memory], poll_delay_us: int) -> None:
    mem = open_memory()
    backend = NixlBackend(poll_delay_us=poll_delay_us)
    try:
        await backend.start()
        await backend.register_memory(mem)  # aclose() deregisters it
        md = await backend.local_metadata()
        ready = {"metadata": md.hex(), "base": mem.base_address, "name": backend.agent_name}
        _emit({"ready": ready})
        await _serve(backend)
    finally:
        await backend.aclose()
        mem.close()


async def _serve(backend: NixlBackend) -> None:
    """Obey stdin's commands and report notifications until stdin closes."""
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line)
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()
    agents: dict[str, RemoteAgent] = {}
    echo = False
    while True:
        while not commands.empty():
            line = commands.get_nowait()
            if line is None:
                return
            cmd = json.loads(line)
            if "add" in cmd:
                agent = await backend.add_remote_agent(bytes.fromhex(cmd["add"]))
                agents[agent.name] = agent
                _emit({"added": agent.name})
            if "notify" in cmd:  # send a notification to an added agent (a rogue's tool)
                note = cmd["notify"]
                for _ in range(int(note.get("times", 1))):
                    await backend.send_notification(
                        agents[note["agent"]], bytes.fromhex(note["payload"])
                    )
                _emit({"notified": note["agent"]})
            echo = bool(cmd["echo"]) if "echo" in cmd else echo
        for n in await backend.drain_notifications():
            if echo and n.agent in agents:
                await backend.send_notification(agents[n.agent], n.payload)
            else:
                _emit({"notif": {"agent": n.agent, "payload": n.payload.hex()}})
        await asyncio.sleep(0 if echo else 0.002)  # echo mode: busy, for latency


def run(args: list[str]) -> None:
    if args[0] == "cuda_ipc":
        handle, device_uuid, offset, size = args[1:5]
        spec = CudaIpcSpec(
            handle=bytes.fromhex(handle),
            device_uuid=device_uuid,
            offset=int(offset),
            size=int(size),
        )
        asyncio.run(main(lambda: import_memory(spec), 1000))
    elif args[0] == "own":
        kind, nbytes, seed = MemoryKind(args[1]), int(args[2]), int(args[3])
        asyncio.run(main(lambda: own_memory(kind, nbytes, seed), 1000))
    else:
        delay = int(args[2]) if len(args) > 2 else 1000
        host = HostShmSpec(path=args[0], size=int(args[1]))
        asyncio.run(main(lambda: import_memory(host), delay))


if __name__ == "__main__":
    run(sys.argv[1:])
