"""The pieces of a layer-sharded group across processes: who is which member and where its peers
are (from a pod's environment, or given), and the hidden state's trip over the wire."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from pdserve_common import pod_env as E
from pdserve_worker.decode.layer_shards import is_follower, member_layers
from pdserve_worker.rpc.convert import hidden_from_proto, hidden_to_proto
from pdserve_worker.serving import settings as S
from pdserve_worker.serving.settings import WorkerSettings

POD = {
    E.ROLE: "decode",
    E.SERVICE: "prod/chat",
    E.BROKER_ADDRESS: "broker.pdserve:50051",
    E.BROKER_TOKEN: "s3cret",
    E.POD_IP: "10.1.2.3",
    E.LAYER_SHARDS: "2",
    E.DECODE_SERVICE: "chat-decode-headless",
}


def settings(monkeypatch, **env: str) -> WorkerSettings:
    for name, value in {**POD, **env}.items():
        monkeypatch.setenv(name, value)
    return WorkerSettings()


def test_a_pod_finds_its_group_from_its_ordinal_and_the_headless_service(monkeypatch):
    s = settings(monkeypatch, **{E.POD_NAME: "chat-decode-3"})
    assert s.group_member == (1, 1) and is_follower(s)
    assert s.peers == [
        f"chat-decode-2.chat-decode-headless:{E.GRPC_PORT}",
        f"chat-decode-3.chat-decode-headless:{E.GRPC_PORT}",
    ]
    leader = settings(monkeypatch, **{E.POD_NAME: "chat-decode-4"})
    assert leader.group_member == (2, 0) and not is_follower(leader)
    assert leader.peers[0].startswith("chat-decode-4.") and leader.peers[1].startswith("chat-decode-5.")


def test_explicit_index_and_peers_win(monkeypatch):
    s = settings(
        monkeypatch, **{E.POD_NAME: "decode-0-1", S.SHARD_INDEX: "1", S.GROUP_PEERS: "127.0.0.1:1, 127.0.0.1:2"}
    )
    assert s.group_member == (0, 1) and s.peers == ["127.0.0.1:1", "127.0.0.1:2"]
    with pytest.raises(ValidationError, match="outside a group of 2"):
        settings(monkeypatch, **{E.POD_NAME: "decode-0-1", S.SHARD_INDEX: "2", S.GROUP_PEERS: "a:1,b:2"})
    with pytest.raises(ValidationError, match="needs 2 member endpoints, got 3"):
        settings(monkeypatch, **{E.POD_NAME: "x-0", S.SHARD_INDEX: "0", S.GROUP_PEERS: "a:1,b:2,c:3"})


def test_each_member_loads_its_balanced_share(monkeypatch, tiny_model_dir):
    s0 = settings(monkeypatch, **{E.POD_NAME: "chat-decode-0"})
    s1 = settings(monkeypatch, **{E.POD_NAME: "chat-decode-1"})
    assert (member_layers(s0, tiny_model_dir), member_layers(s1, tiny_model_dir)) == (range(0, 2), range(2, 4))
    unsharded = settings(monkeypatch, **{E.POD_NAME: "chat-decode-1", E.LAYER_SHARDS: "1"})
    assert member_layers(unsharded, tiny_model_dir) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hidden_state_round_trips_bit_exact(dtype):
    hidden = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    message = hidden_to_proto(hidden, [4, 0, 2], [17, 3, 9])
    back = hidden_from_proto(message)
    assert back.dtype == dtype and torch.equal(back, hidden)
    assert (list(message.slots), list(message.positions)) == ([4, 0, 2], [17, 3, 9])


def test_a_truncated_hidden_state_is_refused():
    message = hidden_to_proto(torch.zeros(2, 1, 8), [0, 1], [1, 1])
    message.data = message.data[:-4]
    with pytest.raises(ValueError, match="needs 64 bytes, got 60"):
        hidden_from_proto(message)


def test_a_followers_notify_of_an_abandoned_generation_never_hides_the_current_one():
    from pdserve_worker.decode.layer_shards import GenerationFloor

    floor = GenerationFloor()
    assert floor.accepts(0, 5)  # filed
    assert not floor.accepts(0, 4)  # a late push of an older request on the same slot
    floor.raise_to(1, 9)  # the leader waits for generation 9 on slot 1
    assert not floor.accepts(1, 8) and floor.accepts(1, 9) and floor.accepts(1, 12)
    assert floor.accepts(2, 1)  # slots are independent


def test_worker_flags_set_the_group(monkeypatch):
    from pdserve_worker.cli.main import build_parser
    from pdserve_worker.cli.worker import settings_from_args

    for name, value in POD.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(
        ["worker", "--layer-shards", "3", "--shard-index", "2", "--group-peers", "h:1,h:2,h:3"]
    )
    s = settings_from_args(args)
    assert (s.layer_shards, s.group_member, s.peers) == (3, (0, 2), ["h:1", "h:2", "h:3"])
