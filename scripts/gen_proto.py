"""Generate Python code (+ .pyi stubs) from proto/ into kvsidecar/v1/.

The proto package is ``kvsidecar.v1``, so protoc's output lives at exactly that import path and needs
no rewriting: a framework that uses the installed package imports ``kvsidecar.v1.engine_pb2`` (and
need not generate its own copy, which would collide with the installed package).

Usage: gen_proto.py [OUT_DIR]   (default: kvsidecar/v1). The drift test runs it into a temporary
directory and compares the result byte for byte with the committed files.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
INIT = (
    '"""Generated from proto/kvsidecar/v1 by scripts/gen_proto.py (`make proto`); do not edit."""\n'
)


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
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        written = []
        for f in sorted(src.iterdir()):
            shutil.copyfile(f, out_dir / f.name)
            written.append(out_dir / f.name)
        (out_dir / "__init__.py").write_text(INIT)
        written.append(out_dir / "__init__.py")
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "kvsidecar" / "v1"
    for path in generate(out):
        print(path.relative_to(out.parent) if out.parent in path.parents else path)
