"""A NIXL target process for the backend contract suite and ``bench_backend`` (the child side;
``kvsidecar.testing.daemon.target_process`` starts it and talks to it).

Usage: ``python -m kvsidecar.testing.daemon.nixl_target SHM_PATH SIZE [POLL_DELAY_US]`` imports ``SHM_PATH``
as host_shm memory; ``... cuda_ipc HANDLE_HEX DEVICE_UUID OFFSET SIZE`` imports CUDA IPC memory. It
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

from kvsidecar.engine.backend import RemoteAgent
from kvsidecar.engine.backend.nixl import NixlBackend
from kvsidecar.memory import CudaIpcSpec, HostShmSpec, MemorySpec, import_memory


def _emit(doc: object) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


async def main(spec: MemorySpec, poll_delay_us: int) -> None:
    mem = import_memory(spec)
    backend = NixlBackend(poll_delay_us=poll_delay_us)
    await backend.start()
    reg = await backend.register_memory(mem)
    md = await backend.local_metadata()
    _emit({"ready": {"metadata": md.hex(), "base": mem.base_address, "name": backend.agent_name}})
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line)
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()
    agents: dict[str, RemoteAgent] = {}
    echo = False
    try:
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
    finally:
        await backend.deregister_memory(reg)
        await backend.aclose()
        mem.close()


def run(args: list[str]) -> None:
    if args[0] == "cuda_ipc":
        handle, uuid, offset, size = args[1:5]
        spec: MemorySpec = CudaIpcSpec(
            handle=bytes.fromhex(handle), device_uuid=uuid, offset=int(offset), size=int(size)
        )
        asyncio.run(main(spec, 1000))
    else:
        delay = int(args[2]) if len(args) > 2 else 1000
        asyncio.run(main(HostShmSpec(path=args[0], size=int(args[1])), delay))


if __name__ == "__main__":
    run(sys.argv[1:])
