"""The committed Python gRPC code is what grpcio-tools generates from blink.proto."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"
GENERATED = ("blink_pb2.py", "blink_pb2.pyi", "blink_pb2_grpc.py")


def test_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools")
    shutil.copytree(PROTO_DIR / "blink", tmp_path / "blink")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path}",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", str(tmp_path / "blink/v1/blink.proto")],
                   check=True)
    for name in GENERATED:
        fresh = (tmp_path / "blink/v1" / name).read_text()
        committed = (PROTO_DIR / "blink/v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run proto/generate.sh"


def test_api_shape():
    from blink.v1 import blink_pb2 as pb
    service = pb.DESCRIPTOR.services_by_name["Blink"]
    assert pb.DESCRIPTOR.package == "blink.v1"
    assert {m.name for m in service.methods} == {"Generate", "GetModelInfo", "GetServerStats"}
    assert service.methods_by_name["Generate"].server_streaming
    assert pb.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    for field in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert pb.SamplingParams.DESCRIPTOR.fields_by_name[field].has_presence
