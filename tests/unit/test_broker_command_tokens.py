"""Where `pdserve broker` takes its tokens from: a YAML/JSON file and/or an env var."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve_worker.cli.broker import TOKENS_ENV, load_tokens, parse_tokens


def test_yaml_and_json_both_parse() -> None:
    assert parse_tokens("ns/a: t1\nns/b: t2\n", "f") == {"ns/a": "t1", "ns/b": "t2"}
    assert parse_tokens('{"ns/a": "t1"}', "f") == {"ns/a": "t1"}
    assert parse_tokens("", "f") == {}


def test_file_wins_over_env_and_both_count(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text('{"ns/a": "from-file"}')
    env = {TOKENS_ENV: "ns/a: from-env\nns/b: env-only\n"}
    assert load_tokens(path, env) == {"ns/a": "from-file", "ns/b": "env-only"}
    assert load_tokens(None, {}) == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "want a mapping"),
        ("noslash: t", "must be 'namespace/name'"),
        ("a/b/c: t", "must be 'namespace/name'"),
        ("ns/a: ''", "non-empty string"),
        ("ns/a: 5", "non-empty string"),
        ("ns/a: [unclosed", "not YAML/JSON"),
    ],
)
def test_bad_tokens_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tokens(text, "tokens.yaml")


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read tokens file .*nope.yaml"):
        load_tokens(tmp_path / "nope.yaml", {})
