from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_worker.model.tokenizer import Tokenizer, TokenizerError

SAMPLES = ["Hello, world!", "café naïve 東京 🙂👍🏽 ∑", "  two  spaces\tand\nlines", "12345 digits", ""]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def test_special_tokens_and_eos(tok):
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == (tok.backend.token_to_id("<|im_end|>"),)
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == tok.backend.token_to_id("<|im_start|>")


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_adds_the_default_system_prompt_only_when_none_is_given(tok):
    user = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(user) == (
        "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *user]
    assert "tiny test model" not in tok.apply_chat_template(with_system)
    assert not tok.apply_chat_template(user, add_generation_prompt=False).endswith("assistant\n")
    assert tok.encode_chat(user) == tok.encode(tok.apply_chat_template(user), add_special_tokens=False)
    with pytest.raises(TokenizerError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_matches_hf_tokenizer_on_the_same_folder(tok, tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for text in SAMPLES:
        assert tok.encode(text) == hf.encode(text)
    conv = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    for gen in (True, False):
        assert tok.apply_chat_template(conv, gen) == hf.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=gen
        )


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=30))
def test_incremental_detokenizer_never_splits_a_character_and_adds_up(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer(skip_special_tokens=False)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_incremental_detokenizer_holds_a_split_character(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span several byte tokens for this test"
    detok = tok.detokenizer()
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🙂"


def test_a_stream_ending_mid_character_flushes_the_replacement_once(tok):
    ids = tok.encode("a🙂", add_special_tokens=False)[:-1]
    detok = tok.detokenizer()
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[-1].startswith("\ufffd")


def test_chat_template_file_overrides_the_config(tmp_path, tiny_model_dir):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "x"}])
