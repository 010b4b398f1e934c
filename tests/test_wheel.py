"""The installed package carries the generated gRPC code at the path its proto package implies.

A framework in another language or repository generates nothing: it imports ``kvsidecar.v1`` from
the wheel (its own generated ``kvsidecar/v1`` would collide with the installed package).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_kvsidecar_v1_importable_from_the_wheel_alone(tmp_path: Path) -> None:
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip_wheel, "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("kvsidecar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("engine_pb2", "engine_pb2_grpc", "geometry_pb2", "peer_pb2", "peer_pb2_grpc"):
        assert f"kvsidecar/v1/{module}.py" in names
        assert f"kvsidecar/v1/{module}.pyi" in names
    assert "kvsidecar/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "kvsidecar/rpc/_gen"))]
    # Import from the wheel file itself (pure Python: importable as a zip), not the source tree.
    code = (
        "from kvsidecar.v1 import engine_pb2, engine_pb2_grpc; "
        "print(engine_pb2.__file__); print(engine_pb2.DESCRIPTOR.package); "
        "print(engine_pb2_grpc.EngineServiceStub.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PYTHONPATH": str(wheel), "PATH": "/usr/bin:/bin"},
    ).stdout.split()
    assert out[0].startswith(str(wheel)), out
    assert out[1:] == ["kvsidecar.v1", "EngineServiceStub"]
