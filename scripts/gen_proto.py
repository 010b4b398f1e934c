"""Generate Python code (+ .pyi stubs) from proto/ into kvsidecar/rpc/_gen/.

Usage: gen_proto.py [OUT_DIR]   (default: kvsidecar/rpc/_gen). The drift test runs it into a temporary
directory and compares the result byte for byte with the committed files.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = "kvsidecar.rpc._gen"
_IMPORT_RE = re.compile(r"^from kvsidecar\.v1 import ", re.MULTILINE)


def _bin(name: str) -> str:
    """The mypy-protobuf plugins live next to the running interpreter (a venv need not be on PATH)."""
    found = Path(sys.executable).parent / name
    return str(found) if found.exists() else (shutil.which(name) or name)


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(PROTO_ROOT.glob("kvsidecar/v1/*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--plugin=protoc-gen-mypy={_bin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_bin('protoc-gen-mypy_grpc')}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        src = Path(tmp) / "kvsidecar" / "v1"
        dst = out_dir / "v1"
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        written = []
        for f in sorted(src.iterdir()):
            text = _IMPORT_RE.sub(f"from {PACKAGE}.v1 import ", f.read_text())
            (dst / f.name).write_text(text)
            written.append(dst / f.name)
        (dst / "__init__.py").write_text("")
        (out_dir / "__init__.py").write_text(
            '"""Generated from proto/ by scripts/gen_proto.py."""\n'
        )
        written += [dst / "__init__.py", out_dir / "__init__.py"]
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "kvsidecar" / "rpc" / "_gen"
    for path in generate(out):
        print(path.relative_to(out.parent) if out.parent in path.parents else path)
