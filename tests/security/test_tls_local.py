"""Issue 13, D8: our own processes could not use TLS (worker gRPC servers plaintext only, no
client passed a TLS config). `pdserve local --tls` now makes a CA for the run and serves with
mutual TLS on every gRPC hop (router -> workers, workers -> broker, a decode group's leader ->
its follower) and HTTPS at the router. Checked against the real processes: an OpenAI client
with the CA gets answers; every TCP port any child listens on refuses a plaintext gRPC call;
the gRPC ports refuse a TLS client without a certificate, and take one with it."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from pdserve.v1 import broker_pb2, broker_pb2_grpc, worker_pb2, worker_pb2_grpc
from support.deployments import local_deployment

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tls_run(tiny_model_dir, tmp_path_factory):
    # One decode instance of two processes, so the leader -> follower hop is exercised too.
    run = local_deployment(
        tmp_path_factory.mktemp("tls-local"), tiny_model_dir, tls=True, decode=1, layer_shards=2, slots=2, max_len=128
    )
    yield run
    run.stop_cleanly()


def listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on: its socket inodes matched against /proc/net/tcp(6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_d8_the_router_serves_https_to_a_client_with_the_run_ca(tls_run):
    ca = tls_run.manifest["ca_file"]
    assert tls_run.url.startswith("https://") and Path(ca).is_file()
    client = openai.OpenAI(
        base_url=f"{tls_run.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        http_client=httpx.Client(verify=ssl.create_default_context(cafile=ca)),
    )
    model = client.models.list().data[0].id
    answer = client.completions.create(model=model, prompt="Over TLS,", max_tokens=6, temperature=0)
    assert answer.choices[0].text and answer.model_extra["pdserve"]["disaggregated"] is True
    # It is real TLS: without the CA the certificate is not trusted, and plain HTTP gets nowhere.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tls_run.url}/health", timeout=5)
    with pytest.raises(httpx.HTTPError):
        reply = httpx.get(tls_run.url.replace("https://", "http://") + "/health", timeout=5)
        reply.raise_for_status()


def test_d8_no_port_of_any_child_answers_plaintext_grpc(tls_run):
    token = (("authorization", f"Bearer {tls_run.token}"),)
    probed = {}
    for child in tls_run.manifest["children"]:
        ports = listening_ports(child["pid"])
        assert ports, f"{child['name']} listens on nothing?"
        for port in ports:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    worker_pb2_grpc.DecodeStub(channel).Status(worker_pb2.StatusRequest(), metadata=token, timeout=3)
                    answered = "answered"
                except grpc.RpcError as exc:
                    answered = exc.code().name
            probed[f"{child['name']}:{port}"] = answered
    assert "answered" not in probed.values(), probed
    names = {key.split(":")[0] for key in probed}
    assert {"broker", "router-0", "prefill-0", "decode-0-0", "decode-0-1"} <= names, probed


def test_d8_grpc_ports_want_a_client_certificate_of_the_run_ca(tls_run):
    files = Path(tls_run.manifest["ca_file"]).parent
    ca, cert, key = ((files / name).read_bytes() for name in ("ca.crt", "tls.crt", "tls.key"))
    token = (("authorization", f"Bearer {tls_run.token}"),)
    leader = tls_run.child("decode-0-0")["grpc"]

    def status(credentials: grpc.ChannelCredentials) -> worker_pb2.DecodeStatus:
        with grpc.secure_channel(leader, credentials) as channel:
            return worker_pb2_grpc.DecodeStub(channel).Status(worker_pb2.StatusRequest(), metadata=token, timeout=5)

    with pytest.raises(grpc.RpcError) as anonymous:
        status(grpc.ssl_channel_credentials(root_certificates=ca))  # TLS, but no client certificate
    assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
    assert status(grpc.ssl_channel_credentials(ca, key, cert)).slots_total == 2  # the positive control
    with grpc.secure_channel(tls_run.manifest["broker"], grpc.ssl_channel_credentials(ca, key, cert)) as channel:
        members = (
            broker_pb2_grpc.BrokerStub(channel)
            .ListMembers(
                broker_pb2.ListMembersRequest(service_key=tls_run.manifest["service"]), metadata=token, timeout=5
            )
            .members
        )
    assert {m.info.role for m in members} >= {broker_pb2.ROLE_DECODE, broker_pb2.ROLE_PREFILL}
