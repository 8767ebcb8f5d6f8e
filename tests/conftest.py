"""Shared fixtures: free loopback ports and process hygiene for tests that start servers."""

from __future__ import annotations

import os

import pytest

from netutil import free_port

# The tests of the push road (faults, digests, migration, traces) need every request pushed by a
# prefill: the router's `auto` choice (router/disaggregation.py) would compute some on the decode
# once the workers report their costs. So routers the suite starts push unless a test asks
# otherwise (`--disaggregation`, RouterConfig.disaggregation); `auto` and `never` have tests of
# their own (test_disaggregation_choice.py, test_local_prefill_serving.py).
os.environ.setdefault("PDSERVE_DISAGGREGATION", "always")


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def local_deployments():
    """`local_deployments(log_dir, model, **keywords)`: `pdserve local` started for one test by
    support.deployments.local_deployment; the test stops it (and asserts on the stop), and any
    it left running, a failure between its start and its stop, is stopped at its end.
    Fixtures of a wider scope call `local_deployment` and stop it after their `yield`."""
    from support.deployments import local_deployment

    runs = []

    def start(log_dir, model, **keywords):
        runs.append(local_deployment(log_dir, model, **keywords))
        return runs[-1]

    yield start
    for run in runs:
        run.stop()  # a no-op for a run the test stopped


# ---- model fixtures (engine) -------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight LLaMA HF folder (about 1 MB), written once per session."""
    from support.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def default_model_dir():
    """The real default model (SmolLM2-135M-Instruct) converted to an fp32 HF folder.

    Converted once into the pdserve cache ($PDSERVE_CACHE_DIR or ~/.cache/pdserve) and reused
    by every test and later session that needs it.
    """
    from pdserve_worker.model.loading.convert import converted_gguf
    from pdserve_worker.model.loading.default_model import default_model_path

    return converted_gguf(default_model_path(), "float32")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """`family_dirs(name)`: the HF folder of a tiny model of family `name` (tests/support/model_families.py),
    built by transformers once per session."""
    from support.model_families import build_family

    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(f"family-{name}"))
        return built[name]

    return get
