"""The upstream CRD files of the kinds pdserve renders but does not own, for the API emulator.

The files under tests/upstream_crds/ are verbatim copies (`git show COMMIT:PATH`; Apache-2.0,
each repository's LICENSE; tests/upstream_crds/SOURCES.txt lists them all). `FILES` names each
with its repository, commit and path, so a test that installs one cites it; `install` posts a
file, unchanged, to the emulator, which admits it with its ported CRD validation and then
prunes, defaults and validates (OpenAPI, enums, CEL) what is created of its kind.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DIR = Path(__file__).resolve().parents[1] / "upstream_crds"
LWS_REPO, LWS_COMMIT = "github.com/kubernetes-sigs/lws", "060ab4da17eea1f0865fcbd3236bb1075e2cea32"
GIE_REPO = "github.com/kubernetes-sigs/gateway-api-inference-extension"
GIE_MAIN, GIE_V150 = "84436a96b9e6ce2b59ddacd3d04c31b4fbd442de", "df9f8909fe06fe2dfd4a6fc0bd0c01a0acabf849"
LLMD_REPO, LLMD_COMMIT = "github.com/llm-d/llm-d-router", "ebab687927f5331c1b39defcb579a07951bce56c"


@dataclass(frozen=True)
class Source:
    """One upstream CRD file: where it came from (repository, commit, path) and its local copy."""

    api_version: str
    kind: str
    repo: str
    commit: str
    path: str  # in the upstream repository; the copy is DIR / <repository name> / path

    @property
    def local(self) -> Path:
        return DIR / self.repo.rsplit("/", 1)[1] / self.path

    def cite(self) -> str:
        return f"{self.repo}@{self.commit[:8]}:{self.path}"


_BASES = "config/crd/bases/"
FILES: dict[tuple[str, str], Source] = {
    (s.api_version, s.kind): s
    for s in (
        Source(
            "leaderworkerset.x-k8s.io/v1",
            "LeaderWorkerSet",
            LWS_REPO,
            LWS_COMMIT,
            _BASES + "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
        ),
        Source(
            "disaggregatedset.x-k8s.io/v1",
            "DisaggregatedSet",
            LWS_REPO,
            LWS_COMMIT,
            _BASES + "disaggregatedset.x-k8s.io_disaggregatedsets.yaml",
        ),
        Source(
            "disaggregatedset.x-k8s.io/v1",
            "DisaggregatedSetRoleScaler",
            LWS_REPO,
            LWS_COMMIT,
            _BASES + "disaggregatedset.x-k8s.io_disaggregatedsetrolescalers.yaml",
        ),
        Source(
            "inference.networking.k8s.io/v1",
            "InferencePool",
            GIE_REPO,
            GIE_MAIN,
            _BASES + "inference.networking.k8s.io_inferencepools.yaml",
        ),
        Source(
            "inference.networking.x-k8s.io/v1alpha2",
            "InferenceObjective",
            GIE_REPO,
            GIE_V150,
            _BASES + "inference.networking.x-k8s.io_inferenceobjectives.yaml",
        ),
        Source(
            "llm-d.ai/v1alpha2",
            "InferenceObjective",
            LLMD_REPO,
            LLMD_COMMIT,
            _BASES + "llm-d.ai_inferenceobjectives.yaml",
        ),
    )
}


@functools.cache
def _load(path: Path) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the LWS files are 1.3-1.5 MB
    doc: dict[str, Any] = yaml.load(path.read_text(), Loader=loader)
    return doc


def crd(api_version: str, kind: str) -> dict[str, Any]:
    """The CRD document of that kind, as the file holds it (a fresh copy each call)."""
    import copy

    return copy.deepcopy(_load(FILES[(api_version, kind)].local))


def schema(api_version: str, kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of that version of the kind."""
    version = api_version.rsplit("/", 1)[1]
    (v,) = [v for v in _load(FILES[(api_version, kind)].local)["spec"]["versions"] if v["name"] == version]
    return dict(v["schema"]["openAPIV3Schema"])


def crd_name(api_version: str, kind: str) -> str:
    return str(_load(FILES[(api_version, kind)].local)["metadata"]["name"])
