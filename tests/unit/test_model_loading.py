"""Loading an HF folder: sharded indexes (and hostile ones), checkpoints that do not match their
config, generation_config.json, and the memory check that runs before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve_worker.model.loading import loader
from pdserve_worker.model.loading.generation_config import GenerationDefaults
from pdserve_worker.model.loading.loader import load_model, loaded_bytes
from pdserve_worker.model.loading.memory import ModelDoesNotFit, _cgroup_available, check_fits, host_available
from pdserve_worker.model.loading.weights import read_safetensors_dir, safetensors_files


@pytest.fixture
def qwen_copy(family_dirs, tmp_path) -> Path:
    """A private copy of the tiny qwen2 folder (sharded, 17 files) to damage."""
    return Path(shutil.copytree(family_dirs("qwen2"), tmp_path / "qwen2"))


def _index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def test_a_member_reads_only_its_layers(qwen_copy):
    every = read_safetensors_dir(qwen_copy)
    some = read_safetensors_dir(qwen_copy, ["model.layers.2.self_attn.q_proj.bias", "model.norm.weight", "absent"])
    assert set(some) == {"model.layers.2.self_attn.q_proj.bias", "model.norm.weight"}
    assert torch.equal(some["model.norm.weight"], every["model.norm.weight"])
    member = load_model(str(qwen_copy), dtype="float32", layers=range(2, 3))
    assert set(member.model.layers) == {2}


def test_the_index_may_not_point_outside_the_folder(qwen_copy, tmp_path):
    index = _index(qwen_copy)
    first = next(iter(index["weight_map"]))
    for bad in ("../outside.safetensors", "/etc/passwd", "sub/model.safetensors", ".."):
        index["weight_map"][first] = bad
        (qwen_copy / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="not a file name inside the folder"):
            safetensors_files(qwen_copy)
    index["weight_map"][first] = "model-99999-of-00017.safetensors"
    (qwen_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-99999-of-00017.safetensors"):
        load_model(str(qwen_copy), dtype="float32")
    (qwen_copy / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        safetensors_files(qwen_copy)


def _rewrite_tensor(folder: Path, name: str, tensor: torch.Tensor | None) -> None:
    """Replace (or with None drop) one tensor in whichever shard holds it."""
    file = folder / _index(folder)["weight_map"][name]
    tensors = load_file(str(file))
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_a_checkpoint_that_does_not_match_its_config_is_refused_naming_the_tensor(qwen_copy):
    _rewrite_tensor(qwen_copy, "model.layers.1.self_attn.k_proj.bias", torch.zeros(16))
    with pytest.raises(
        ValueError, match=r"'model.layers.1.self_attn.k_proj.bias' has shape \(16,\), config.json implies \(32,\)"
    ):
        load_model(str(qwen_copy), dtype="float32")
    _rewrite_tensor(qwen_copy, "model.layers.1.self_attn.k_proj.bias", None)
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.self_attn.k_proj.bias', which the index places"):
        load_model(str(qwen_copy), dtype="float32")
    index = _index(qwen_copy)
    del index["weight_map"]["model.layers.1.self_attn.k_proj.bias"]
    (qwen_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.k_proj.bias' missing"):
        load_model(str(qwen_copy), dtype="float32")


def test_an_untied_config_needs_its_lm_head(qwen_copy):
    _rewrite_tensor(qwen_copy, "lm_head.weight", None)
    index = _index(qwen_copy)
    del index["weight_map"]["lm_head.weight"]
    (qwen_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'lm_head.weight' missing .*tie_word_embeddings is false"):
        load_model(str(qwen_copy), dtype="float32")


def test_generation_config_gives_eos_lists_and_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [151645, 151643],
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "transformers_version": "4.37.0",
            }
        )
    )
    gen = GenerationDefaults.from_folder(tmp_path)
    assert gen.eos_token_ids == (151645, 151643)
    assert gen.sampling_defaults() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.6}).sampling_defaults() == {
        "temperature": 0.0
    }
    # Greedy search applies the file's repetition penalty too (transformers does).
    greedy = GenerationDefaults.from_dict({"do_sample": False, "repetition_penalty": 1.1})
    assert greedy.sampling_defaults() == {"temperature": 0.0, "repetition_penalty": 1.1}
    assert GenerationDefaults.from_folder(tmp_path / "absent") == GenerationDefaults()
    for bad, message in [
        ({"eos_token_id": "</s>"}, "eos_token_id"),
        ({"top_p": 0}, r"top_p 0 outside \(0"),
        ({"temperature": -1}, "temperature -1"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"do_sample": "yes"}, "do_sample must be true or false"),
    ]:
        with pytest.raises(ValueError, match=message):
            GenerationDefaults.from_dict(bad)


# ---- memory ------------------------------------------------------------------------------------------


def test_weights_that_do_not_fit_are_refused_before_loading_naming_both_figures(qwen_copy, monkeypatch):
    config = load_model(str(qwen_copy), dtype="float32").config
    reads = []
    monkeypatch.setattr(loader, "read_safetensors_dir", lambda *a, **k: reads.append(a) or {})
    monkeypatch.setattr(loader, "device_available", lambda device: (100_000, "MemAvailable"))
    needed = loaded_bytes(config, "bfloat16", range(3), torch.device("cpu"))
    assert needed == (347_520) * 2
    with pytest.raises(ModelDoesNotFit) as err:
        load_model(str(qwen_copy), dtype="bfloat16")
    message = str(err.value)
    assert f"({needed} bytes)" in message and "(100000 bytes) available (MemAvailable)" in message
    assert "layers 0..2, bfloat16" in message and "cpu" in message
    assert reads == []  # refused before a single tensor was read
    assert isinstance(err.value, RuntimeError)  # the worker turns it into a clean startup failure
    # A member of a layer-sharded group needs only its share.
    member = loaded_bytes(config, "bfloat16", range(2, 3), torch.device("cpu"))
    assert member < needed


def test_a_tied_head_on_the_cpu_counts_its_packed_copy(family_dirs):
    config = load_model(str(family_dirs("qwen3")), dtype="float32").config
    assert config.tie_word_embeddings
    cpu = loaded_bytes(config, "bfloat16", range(3), torch.device("cpu"))
    assert (
        cpu
        == loaded_bytes(config, "bfloat16", range(3), torch.device("meta")) + config.vocab_size * config.hidden_size * 2
    )


def test_unknown_availability_passes_and_enough_passes():
    check_fits(10**12, None, "unknown", "w", "cpu")
    check_fits(100, 100, "x", "w", "cpu")
    with pytest.raises(ModelDoesNotFit, match="need 0.00 GiB .101 bytes. but npu:0 has"):
        check_fits(101, 100, "torch.npu.mem_get_info", "w", "npu:0")


def test_cgroup_availability_is_limit_minus_working_set(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("700000\n")
    (v2 / "memory.stat").write_text("anon 400000\nfile 300000\ninactive_file 200000\nactive_file 100000\n")
    assert _cgroup_available(v2) == 1_000_000 - (700_000 - 200_000)
    (v2 / "memory.max").write_text("max\n")
    assert _cgroup_available(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("2000000\n")
    (v1 / "memory.usage_in_bytes").write_text("1500000\n")
    (v1 / "memory.stat").write_text("cache 10\ntotal_inactive_file 500000\n")
    assert _cgroup_available(tmp_path / "v1") == 1_000_000
    (v1 / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1's "unlimited"
    assert _cgroup_available(tmp_path / "v1") is None
    assert _cgroup_available(tmp_path / "nothing") is None


def test_host_availability_is_known_on_this_machine():
    available, source = host_available()
    assert available is not None and available > 0 and source in ("MemAvailable", "cgroup limit - working set")


@pytest.mark.asyncio
async def test_a_worker_whose_weights_do_not_fit_exits_before_it_registers(family_dirs, monkeypatch, caplog):
    """`pdserve worker --role decode` with too little memory: exit 1, the log names both figures,
    and the broker never hears of it (nothing even connects to the broker's port)."""
    import asyncio
    import logging
    import socket

    from netutil import free_port
    from pdserve_worker.process.worker_main import run_worker
    from pdserve_worker.serving.settings import WorkerSettings

    broker = socket.socket()
    broker.bind(("127.0.0.1", 0))
    broker.listen()
    broker.setblocking(False)
    monkeypatch.setattr(loader, "device_available", lambda device: (4096, "cgroup limit - working set"))
    settings = WorkerSettings(
        role="decode",
        broker_address=f"127.0.0.1:{broker.getsockname()[1]}",
        broker_token="t0ken",
        model_source=str(family_dirs("qwen2")),
        model_dtype="float32",
        bind_host="127.0.0.1",
        http_port=free_port(),
        grpc_port=free_port(),
        transfer_port=free_port(),
        slots=2,
        max_length=64,
        grace_seconds=0,
    )
    with caplog.at_level(logging.ERROR, logger="pdserve_worker.process.worker_main"):
        code = await asyncio.wait_for(run_worker(settings), 60)
    assert code == 1
    failure = next(r.getMessage() for r in caplog.records if "worker_start_failed" in r.getMessage())
    assert "need" in failure and "(4096 bytes) available (cgroup limit - working set)" in failure
    with pytest.raises(BlockingIOError):
        broker.accept()
    broker.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_max_length_beyond_the_model_is_a_start_failure_not_a_traceback(family_dirs, role, caplog):
    """`spec.model.maxLength` (PDSERVE_MAX_LENGTH) above the model's context: the worker exits 1
    with one `worker_start_failed` line that names both numbers, before it registers (it raised
    out of the role's constructor as a traceback before)."""
    import asyncio
    import logging
    import socket

    from netutil import free_port
    from pdserve_worker.process.worker_main import run_worker
    from pdserve_worker.serving.settings import WorkerSettings

    broker = socket.socket()
    broker.bind(("127.0.0.1", 0))
    broker.listen()
    broker.setblocking(False)
    settings = WorkerSettings(
        role=role,
        broker_address=f"127.0.0.1:{broker.getsockname()[1]}",
        broker_token="t0ken",
        model_source=str(family_dirs("qwen2")),
        model_dtype="float32",
        bind_host="127.0.0.1",
        http_port=free_port(),
        grpc_port=free_port(),
        transfer_port=free_port(),
        slots=2,
        max_length=4096,
        grace_seconds=0,
    )
    with caplog.at_level(logging.ERROR, logger="pdserve_worker.process.worker_main"):
        code = await asyncio.wait_for(run_worker(settings), 60)
    assert code == 1
    failure = next(r.getMessage() for r in caplog.records if "worker_start_failed" in r.getMessage())
    assert "max_len 4096 exceeds the model's max_position_embeddings 256" in failure
    with pytest.raises(BlockingIOError):
        broker.accept()
    broker.close()
