"""A real SGLang scheduler process, as ``launch_server`` runs one: ``run_scheduler_process`` (it
loads the plugins, publishes the runtime context, builds the model, the KV pool, the metadata
buffers and the disaggregation queues, whose ``_init_kv_manager`` builds the transfer backend's
manager) for one rank, in this process. Used by tests/sglang/test_sglang_scheduler.py.

    python -m tests.sglang.scheduler_proc '<json list of launch_server arguments>'

Prints ``SCHEDULER <pid>`` when the scheduler process is spawned, ``READY <init info json>``
once it is built (SGLang's own handshake message to its launcher); it then runs its event loop
until this process is stopped. A prefill instance's bootstrap server
(which ``launch_server``'s main process starts) is started here first. The launcher's other
processes (tokenizer, detokenizer, HTTP) are not started: nothing sends this scheduler requests.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import warnings

warnings.simplefilter("ignore")
import tests.sglang._cpu_shim  # noqa: E402,F401  (before anything imports sglang)


def main(argv: list[str]) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # before the names below are bound here: hooks rebind module attributes
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.server_args import PortArgs, prepare_server_args

    server_args = prepare_server_args(argv)
    if server_args.disaggregation_mode == "prefill":
        bootstrap = get_kv_class(
            TransferBackend(server_args.disaggregation_transfer_backend),
            KVClassType.BOOTSTRAP_SERVER,
        )
        bootstrap(host=server_args.host, port=server_args.disaggregation_bootstrap_port)
    port_args = PortArgs.init_new(server_args)
    reader, writer = multiprocessing.Pipe(duplex=False)
    # A process of its own, as launch_server spawns it (a failing scheduler signals its parent).
    proc = multiprocessing.get_context("spawn").Process(
        target=run_scheduler_process,
        args=(server_args, port_args, 0, 0, 0, None, writer),
        daemon=True,
    )

    def stop(signum: int, frame: object) -> None:
        proc.kill()
        os._exit(1 if signum == signal.SIGQUIT else 0)

    signal.signal(signal.SIGQUIT, stop)
    signal.signal(signal.SIGTERM, stop)
    proc.start()
    print(f"SCHEDULER {proc.pid}", flush=True)
    print("READY " + json.dumps(reader.recv(), default=str), flush=True)
    proc.join()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
