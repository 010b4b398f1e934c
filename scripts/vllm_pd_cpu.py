"""Prefill on one vLLM engine, decode on another, the KV moving through two kvsidecars (CPU).

Run with the vLLM venv (`make setup-vllm` creates it): `.venv-vllm/bin/python scripts/vllm_pd_cpu.py`.
It makes a tiny random Llama (no download), starts two `kvsidecar serve` processes with a
throwaway PKI, two `vllm.LLM` engines using KvSidecarConnector, and prints the decode engine's
continuation next to the prefill engine's own one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvsidecar.client import SidecarClient  # noqa: E402
from kvsidecar.testing.pki import make_peer_certificates  # noqa: E402
from kvsidecar.testing.vllm.tiny_llama import make_tiny_llama  # noqa: E402


def sidecar(workdir: Path, name: str, tls_flags: list[str]) -> tuple[subprocess.Popen[bytes], dict]:
    ready = workdir / f"{name}.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsidecar.cli",
            "serve",
            "--ready-file",
            str(ready),
            "--engine-socket",
            str(workdir / f"{name}.sock"),
            "--peer-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            *tls_flags,
        ],
        stdout=(workdir / f"{name}.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    for _ in range(1500):
        if ready.exists():
            return proc, json.loads(ready.read_text())
        if proc.poll() is not None:
            raise SystemExit(f"sidecar {name} exited: {(workdir / f'{name}.log').read_text()}")
        time.sleep(0.01)
    proc.kill()
    raise SystemExit(f"sidecar {name} not ready")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    workdir = Path(tempfile.mkdtemp(prefix="kvsidecar-vllm-"))
    model = make_tiny_llama(workdir / "tiny-llama")
    certs = make_peer_certificates(workdir / "pki")
    procs = {}
    try:
        for name in ("prefill", "decode"):
            procs[name] = sidecar(workdir, name, list(certs.flags()))

        def engine(name: str) -> LLM:
            return LLM(
                model=str(model),
                skip_tokenizer_init=True,
                enforce_eager=True,
                dtype="float32",
                block_size=32,
                max_model_len=256,
                kv_cache_memory_bytes=32 << 20,
                seed=0,
                kv_transfer_config=KVTransferConfig(
                    kv_connector="KvSidecarConnector",
                    kv_connector_module_path="kvsidecar.integrations.vllm.connector",
                    kv_role="kv_both",
                    engine_id=name,
                    kv_connector_extra_config={"sidecar_socket": procs[name][1]["engine_socket"]},
                ),
            )

        prefill, decode = engine("prefill"), engine("decode")
        prompt = TokensPrompt(prompt_token_ids=[(7 * i + 3) % 2000 + 10 for i in range(80)])
        greedy = {"temperature": 0.0, "ignore_eos": True}
        own = prefill.generate([prompt], SamplingParams(max_tokens=8, **greedy), use_tqdm=False)
        handed = prefill.generate(
            [prompt],
            SamplingParams(
                max_tokens=1,
                extra_args={"kv_transfer_params": {"do_remote_decode": True}},
                **greedy,
            ),
            use_tqdm=False,
        )
        params = handed[0].kv_transfer_params
        print("kv_transfer_params:", {k: v for k, v in params.items() if k != "remote_token"})
        out = decode.generate(
            [prompt],
            SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params}, **greedy),
            use_tqdm=False,
        )
        print("prefill engine's own continuation:", list(own[0].outputs[0].token_ids))
        print("decode engine's continuation:     ", list(out[0].outputs[0].token_ids))
        for name, (_, addresses) in procs.items():
            with SidecarClient(addresses["engine_socket"]) as client:
                c = client.status().counters
            print(
                f"{name} sidecar: reads_done={c['reads_done']} bytes_read={c['bytes_read']} "
                f"sends_done={c['sends_done']} leases_expired={c['leases_expired']}"
            )
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(15)


if __name__ == "__main__":
    main()
