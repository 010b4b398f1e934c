"""`make bench-vllm`'s engines pick their vector ISA without inductor's build probe.

Inductor decides per process which vector ISA its CPU kernels use by building and loading a probe
(bounded); on a loaded host the probe passed in one process of an engine and not in another, and
a kernel generated for the ISA was built without it (``CppCompileError: 'at::vec' has not been
declared``, seen in the vLLM tests, which build scalar kernels since). The bench's engines take
every ISA the CPU reports instead (``TORCHINDUCTOR_VEC_ISA_OK=1``): vectorized, as users run
them, and the same in every process whatever a probe would have done. (Today's bench engines,
eager with greedy sampling, compile nothing; the setting is for whatever a change makes them
compile.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vllm.engines import engine_env
from benchmarks.vllm.settings import INDUCTOR_ENV, VEC_ISA_ENV, Settings

# A probe that fails (as one that timed out under load): which ISA does this process pick?
_PICK = """
import torch._inductor.cpu_vec_isa as v
v.VecISA.check_build = lambda self, code: False
print(v.pick_vec_isa().bit_width())
"""


def _pick(tmp_path: Path, vec_isa_ok: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != VEC_ISA_ENV}
    env[INDUCTOR_ENV] = str(tmp_path / "inductor")
    if vec_isa_ok is not None:
        env[VEC_ISA_ENV] = vec_isa_ok
    out = subprocess.run(
        [sys.executable, "-c", _PICK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_every_engine_of_the_bench_takes_the_cpus_isas_unprobed(tmp_path: Path) -> None:
    for connector in ("kvsidecar", "nixl"):
        for side in ("prefill", "decode"):
            env = engine_env(Settings(), tmp_path, connector, side)
            assert env[VEC_ISA_ENV] == "1"
            assert env[INDUCTOR_ENV] == str(tmp_path / "inductor")


def test_the_setting_makes_the_isa_independent_of_the_probe(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    probed = _pick(tmp_path, None)
    unprobed = _pick(tmp_path, "1")
    if unprobed == 0:
        pytest.skip("this CPU reports no vector ISA inductor knows")
    assert probed == 0  # a failed probe: scalar kernels in this process, vectorized in another
    assert unprobed > 0  # the CPU's ISA, whatever the probe does
