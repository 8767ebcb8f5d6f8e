"""The checked-in stubs are what grpcio-tools makes of the checked-in protos."""

from __future__ import annotations

import shutil
from pathlib import Path

from pdserve_worker.rpc import codegen


def test_committed_stubs_match_a_fresh_generation() -> None:
    stale = codegen.check()
    assert stale == [], f"regenerate with `pdserve protos`: {stale}"


def test_check_notices_a_proto_edited_without_regenerating(tmp_path: Path) -> None:
    shutil.copytree(codegen.proto_root() / "pdserve", tmp_path / "pdserve")
    proto = tmp_path / "pdserve" / "v1" / "worker.proto"
    edited = proto.read_text().replace("message StatusRequest {}", "message StatusRequest { bool verbose = 1; }")
    proto.write_text(edited)
    assert codegen.check(tmp_path) == ["worker_pb2.py", "worker_pb2.pyi"]


def test_generated_modules_import_under_the_package_name() -> None:
    from pdserve.v1 import broker_pb2, broker_pb2_grpc, worker_pb2, worker_pb2_grpc

    assert broker_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert {m.name for m in broker_pb2.DESCRIPTOR.services_by_name["Broker"].methods} == {
        "Register",
        "KeepAlive",
        "Watch",
        "SetDraining",
        "Deregister",
        "ListMembers",
    }
    assert {m.name for m in worker_pb2.DESCRIPTOR.services_by_name["Decode"].methods} == {
        "Reserve",
        "Generate",
        "Release",
        "Status",
        "Migrate",
        "BlockEvents",
    }
    assert hasattr(broker_pb2_grpc, "BrokerStub") and hasattr(worker_pb2_grpc, "PrefillStub")
