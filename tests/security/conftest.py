"""Fixtures of the security tests: a `pdserve local` deployment (tiny model) to attack, the
reference answers its victims must still get, and stand-in decode processes with the knobs
the resource tests turn down."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from netutil import free_port  # noqa: E402
from pdserve_common.kv_layout import KVLayout  # noqa: E402
from pdserve_worker.transfer.backends.host import link_auth  # noqa: E402
from support.deployments import local_deployment
from support.local_run import LocalRun  # noqa: E402
from support.transfer_peers import PeerProcess, decode_main  # noqa: E402

MAX_LEN = 128
SLOTS = 8  # tests that abandon a grant leave its slot quarantined for the rest of the session
TOKEN = "security-test-service-token"
KEY = link_auth.derive_key(TOKEN, link_auth.PURPOSE_LINK)
HTTP_DEADLINE_S = 2.0
HTTP_MAX_CONNECTIONS = 64
HTTP_MAX_CONNECTIONS_PER_PEER = 16
GRPC_HANDSHAKE_MS = 1500
GRPC_IDLE_MS = 2500
GRPC_MAX_CONNECTIONS = 48
BROKER_MAX_MEMBERS = 32
EPP_PORT = free_port()  # router-0's endpoint picker (test_a3_picker_flood.py)


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """Colocated greedy generation in this process: what every victim's answer must equal."""
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams

    loaded = load_model(str(tiny_model_dir), dtype="float32")

    class Reference:
        tokenizer = loaded.tokenizer

        def complete(self, prompt_ids: list[int], max_tokens: int) -> str:
            [done] = generate(
                loaded.model,
                loaded.tokenizer,
                [prompt_ids],
                SamplingParams(max_tokens=max_tokens, temperature=0),
                max_len=MAX_LEN,
            )
            return done.text

    return Reference()


@pytest.fixture(scope="session")
def local(tiny_model_dir, tmp_path_factory) -> Iterator[LocalRun]:
    """One prefill, one decode, a router: the deployment the attacks run against.

    Its KV travels over TCP (as between pods), not shared memory, so every genuine push goes
    through the decode engine's server and its lease check while the attacks run."""
    saved = os.environ.get("PDSERVE_ENGINE_OPTIONS")
    os.environ["PDSERVE_ENGINE_OPTIONS"] = json.dumps({"pdserve.Transport": "tcp"})
    try:
        run = local_deployment(
            tmp_path_factory.mktemp("sec-local"),
            tiny_model_dir,
            decode=1,
            slots=SLOTS,
            max_len=MAX_LEN,
            layers_per_chunk=1,
            epp_port=EPP_PORT,
            env={
                # Every HTTP port's bounds on unfinished requests, turned down so the tests are quick.
                "PDSERVE_HTTP_REQUEST_DEADLINE_SECONDS": HTTP_DEADLINE_S,
                "PDSERVE_HTTP_MAX_CONNECTIONS": HTTP_MAX_CONNECTIONS,
                "PDSERVE_HTTP_MAX_CONNECTIONS_PER_PEER": HTTP_MAX_CONNECTIONS_PER_PEER,
                # And every gRPC port's (pdserve_common/channels.py), for test_grpc_bounds.py.
                "PDSERVE_GRPC_HANDSHAKE_TIMEOUT_MS": GRPC_HANDSHAKE_MS,
                "PDSERVE_GRPC_IDLE_TIMEOUT_MS": GRPC_IDLE_MS,
                "PDSERVE_GRPC_MAX_CONNECTIONS": GRPC_MAX_CONNECTIONS,
                "PDSERVE_BROKER_MAX_MEMBERS": BROKER_MAX_MEMBERS,  # test_broker_bounds.py
            },
        )
    finally:
        if saved is None:
            del os.environ["PDSERVE_ENGINE_OPTIONS"]
        else:
            os.environ["PDSERVE_ENGINE_OPTIONS"] = saved
    yield run
    run.stop_cleanly()


@pytest.fixture
def decode_peer() -> Iterator[Callable[..., PeerProcess]]:
    """Start a stand-in decode process (the host engine's server in a subprocess) with the
    service key and a worker's access options, plus any `options` a test turns down."""
    started: list[PeerProcess] = []

    def start(slots: int = 2, **options: str) -> PeerProcess:
        layout = KVLayout(num_slots=slots, num_layers=2, max_len=64, kv_heads=2, head_dim=16, dtype="bfloat16")
        config: dict[str, Any] = {
            "engine_id": f"127.0.0.1:{free_port()}",
            "layout": layout.to_dict(),
            "options": {
                "pdserve.AuthKey": KEY.hex(),
                "pdserve.RemoteWrite": "leased",
                "pdserve.RemoteRead": "0",
                **options,
            },
        }
        peer = PeerProcess.start(decode_main, config)
        peer.info["layout"] = layout
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.stop()


def decode_engine_id(run: LocalRun) -> str:
    """The decode's transfer engine, as the broker lists it to the service's members."""
    import grpc

    from pdserve.v1 import broker_pb2, broker_pb2_grpc

    with grpc.insecure_channel(run.manifest["broker"]) as channel:
        members = (
            broker_pb2_grpc.BrokerStub(channel)
            .ListMembers(
                broker_pb2.ListMembersRequest(service_key="local/pdserve", roles=[broker_pb2.ROLE_DECODE]),
                metadata=(("authorization", f"Bearer {run.token}"),),
                timeout=5,
            )
            .members
        )
    [member] = members
    return member.info.engine_id


def complete(run: LocalRun, prompt: str, max_tokens: int) -> str:
    """A greedy completion through the deployment's router (what a user sees)."""
    import httpx

    with httpx.Client(base_url=run.url, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = http.post(
            "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        ).json()
    assert "choices" in body, body
    return body["choices"][0]["text"]
