"""Worker settings: the operator's environment (pod_env names) in, flags on top, errors named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve_common import pod_env as E
from pdserve_worker.cli.main import build_parser
from pdserve_worker.cli.worker import settings_from_args
from pdserve_worker.serving.settings import WorkerSettings, model_revision

POD = {
    E.ROLE: "decode",
    E.SERVICE: "prod/chat",
    E.BROKER_ADDRESS: "broker.pdserve:50051",
    E.BROKER_TOKEN: "s3cret",
    E.POD_NAME: "chat-decode-3",
    E.POD_IP: "10.1.2.3",
    E.SLOTS: "16",
    E.READINESS_MODE: "poll",
    E.POLL_INTERVAL_MICROS: "250",
    E.WARMUP: "false",
    E.ENGINE_OPTIONS: '{"pdserve.Transport": "tcp"}',
    E.MODEL_DTYPE: "float16",
    E.MAX_LENGTH: "4096",
}


@pytest.fixture
def pod_env(monkeypatch):
    for name, value in POD.items():
        monkeypatch.setenv(name, value)


def test_a_pod_is_configured_by_the_operators_variables(pod_env):
    s = WorkerSettings()
    assert (s.role, s.service, s.broker_address, s.token) == ("decode", "prod/chat", "broker.pdserve:50051", "s3cret")
    assert s.member_id == "chat-decode-3"
    assert s.grpc_endpoint == f"10.1.2.3:{E.GRPC_PORT}" and s.engine_id.startswith("10.1.2.3:")
    assert (s.slots, s.readiness_mode, s.poll_interval_micros, s.warmup) == (16, "poll", 250, False)
    assert s.engine_options == {"pdserve.Transport": "tcp"}
    assert (s.model_dtype, s.max_length, s.model_path) == ("float16", 4096, None)  # builtin: the bundled model
    assert "s3cret" not in repr(s)


def test_flags_override_the_environment(pod_env):
    args = build_parser().parse_args(["worker", "--role", "prefill", "--slots", "3", "--model", "/models/x"])
    s = settings_from_args(args)
    assert (s.role, s.slots, s.model_path, s.broker_address) == ("prefill", 3, "/models/x", "broker.pdserve:50051")


def test_plain_names_in_the_environment_are_not_read(monkeypatch):
    monkeypatch.setenv("ROLE", "router")
    monkeypatch.setenv("SLOTS", "99")
    s = WorkerSettings(role="colocated")
    assert s.slots == 8


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({E.BROKER_TOKEN: ""}, E.BROKER_TOKEN),
        ({E.LAYER_SHARDS: "2"}, "PDSERVE_GROUP_PEERS"),  # a member that cannot find its group
        ({E.ROLE: "prefill", E.LAYER_SHARDS: "2"}, "only decode workers are layer-sharded"),
        ({E.MODEL_SOURCE: "builtin:llama-70b"}, "builtin:llama-70b"),
        ({E.SLOTS: "0"}, E.SLOTS),
        ({E.READINESS_MODE: "sometimes"}, E.READINESS_MODE),
        ({E.ROLE: "router", E.TENSOR_PARALLEL: "2"}, "a router is not a model instance"),
        # (PDSERVE_LAYER_SHARDS=2 on a decode: its group peers are checked first, so a group of one peer
        # named at all passes that check and the tensor-parallel one speaks)
        ({E.TENSOR_PARALLEL: "2", E.KV_BLOCK_TOKENS: "0"}, "needs a paged KV pool"),
    ],
)
def test_invalid_settings_name_what_is_wrong(pod_env, monkeypatch, env, needle):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=needle):
        WorkerSettings()


def test_revision_follows_architecture_and_dtype_not_formatting(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 4}')
    (b / "config.json").write_text('{\n  "num_hidden_layers": 4,\n  "hidden_size": 64\n}')
    assert model_revision(a, "float32") == model_revision(b, "float32")
    assert model_revision(a, "float32") != model_revision(a, "bfloat16")
    (b / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 5}')
    assert model_revision(a, "float32") != model_revision(b, "float32")


def test_tls_needs_all_three_files(pod_env, monkeypatch):
    monkeypatch.setenv(E.TLS_CERT, "/etc/pdserve/tls/tls.crt")
    with pytest.raises(ValidationError, match="missing PDSERVE_TLS_KEY, PDSERVE_TLS_CA"):
        WorkerSettings()


def test_tls_settings_say_how_each_peer_is_dialled(pod_env, monkeypatch):
    assert WorkerSettings().tls is None and WorkerSettings().broker_channel_tls is None
    for name, value in {
        E.TLS_CERT: "/t/tls.crt",
        E.TLS_KEY: "/t/tls.key",
        E.TLS_CA: "/t/ca.crt",
        E.TLS_SERVER_NAME: "chat.prod.svc",
    }.items():
        monkeypatch.setenv(name, value)
    s = WorkerSettings()
    assert s.tls is not None and s.tls.ca_file is not None  # servers require client certificates
    assert s.peer_tls.server_name == "chat.prod.svc"  # workers are dialled by IP
    assert s.broker_channel_tls is not None and s.broker_channel_tls.server_name is None  # by its own name
    monkeypatch.setenv(E.BROKER_TLS, "false")
    assert WorkerSettings().broker_channel_tls is None


def test_a_tls_broker_without_a_certificate_is_a_clear_error(pod_env, monkeypatch):
    monkeypatch.setenv(E.BROKER_TLS, "true")
    with pytest.raises(ValidationError, match="the broker speaks TLS, but no certificate is configured"):
        WorkerSettings()


def test_a_decode_may_be_tensor_parallel_but_not_also_layer_sharded(pod_env, monkeypatch):
    monkeypatch.setenv(E.TENSOR_PARALLEL, "2")
    assert WorkerSettings().tensor_parallel == 2
    monkeypatch.setenv(E.LAYER_SHARDS, "2")
    with pytest.raises(ValidationError, match="tensor-parallel or layer-sharded, not both"):
        WorkerSettings(group_peers="a:1,b:2")
