"""The committed generated code equals what `make proto` produces from proto/."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "kvsidecar" / "v1"


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    out = tmp_path / "v1"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    fresh = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    committed = sorted(
        p.relative_to(COMMITTED)
        for p in COMMITTED.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh == committed, "generated file set differs; run `make proto`"
    differing = [str(p) for p in fresh if not filecmp.cmp(out / p, COMMITTED / p, shallow=False)]
    assert differing == [], f"stale generated code {differing}; run `make proto`"
