"""vLLM's front door on one CPU host: two OpenAI servers (prefill, decode), one kvsidecar each, and
the P/D router, then one request through the router next to the prefill instance's own answer.

Run with the vLLM venv (`make setup-vllm` creates it): `.venv-vllm/bin/python
scripts/vllm_pd_serve.py` (`--keep` leaves everything running for your own requests until
Ctrl-C). It makes a tiny random Llama with a word tokenizer (no download), a throwaway PKI for
the sidecars, and removes everything it made on the way out. docs/vllm.md has the commands it
runs, for a real deployment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvsidecar.testing.vllm.front_door import MODEL_NAME, front_door  # noqa: E402
from kvsidecar.testing.vllm.tiny_llama import add_word_tokenizer, make_tiny_llama  # noqa: E402


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer: dict[str, object] = json.loads(resp.read())
        return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep serving until Ctrl-C")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop everything on the way out
    with tempfile.TemporaryDirectory(prefix="kvsidecar-front-door-") as tmp:
        workdir = Path(tmp)
        model = add_word_tokenizer(make_tiny_llama(workdir / "tiny-llama"))
        print("starting two sidecars, two OpenAI servers and the router (about a minute)...")
        with front_door(model, workdir) as door:
            prompt = " ".join(f"w{(7 * i + 3) % 2000 + 10}" for i in range(80))
            request = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8,
                       "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            own = post(f"{door.prefill}/v1/completions", request)
            routed = post(f"{door.router}/v1/completions", request)
            print("prefill instance's own answer:", own["choices"][0]["text"])  # type: ignore[index]
            print("through the router (P/D):     ", routed["choices"][0]["text"])  # type: ignore[index]
            print(f"router: {door.router}  prefill: {door.prefill}  decode: {door.decode}")
            if args.keep:
                print(
                    f"try: curl -s {door.router}/v1/completions -H 'Content-Type: "
                    f"application/json' -d '{json.dumps(request)}'\nCtrl-C stops everything."
                )
                with contextlib.suppress(KeyboardInterrupt):
                    threading.Event().wait()


if __name__ == "__main__":
    main()
