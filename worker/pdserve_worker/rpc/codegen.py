"""Generate the Python stubs of pdserve's protos with grpcio-tools.

The stubs are checked in beside the sources (`proto/pdserve/v1/*_pb2*.py(i)`) so that the
package imports without grpcio-tools; `check()` (run by a test and by `pdserve protos
--check`) regenerates into a temporary folder and reports every file that differs, so a
`.proto` edit without regeneration fails CI. grpcio-tools is pinned exactly in the dev extra:
the generated files embed its version.
"""

from __future__ import annotations

import importlib.resources
import tempfile
from pathlib import Path

GENERATED_SUFFIXES: tuple[str, ...] = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_root() -> Path:
    """The folder that holds `pdserve/v1/*.proto`: the import root of the generated modules."""
    return Path(str(importlib.resources.files("pdserve"))).parent


def proto_sources(root: Path) -> list[Path]:
    sources = sorted((root / "pdserve" / "v1").glob("*.proto"))
    if not sources:
        raise FileNotFoundError(f"no .proto files under {root / 'pdserve' / 'v1'}")
    return sources


def generate(out_root: Path, root: Path | None = None) -> list[Path]:
    """Write the stubs of every proto under `root` into `out_root/pdserve/v1/`; return them."""
    from grpc_tools import protoc  # dev dependency: imported only when generating

    root = root or proto_root()
    sources = proto_sources(root)
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(s.relative_to(root)) for s in sources),
    ]
    (out_root / "pdserve" / "v1").mkdir(parents=True, exist_ok=True)
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc} for {[s.name for s in sources]}")
    return sorted(generated_files(out_root))


def generated_files(root: Path) -> list[Path]:
    folder = root / "pdserve" / "v1"
    return sorted(p for p in folder.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def check(root: Path | None = None) -> list[str]:
    """Regenerate into a temporary folder; return the names of stale, missing or extra stubs."""
    root = root or proto_root()
    with tempfile.TemporaryDirectory(prefix="pdserve-protos-") as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp), root)}
    committed = {p.name: p.read_bytes() for p in generated_files(root)}
    stale = [name for name in sorted(fresh) if committed.get(name) != fresh[name]]
    extra = [name for name in sorted(committed) if name not in fresh]
    return stale + extra
