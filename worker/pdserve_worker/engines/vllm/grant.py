"""What pdserve's vLLM connector carries: the KV geometry of a worker, the grant, the settings.

- `KVGeometry`: where a vLLM worker's KV cache lies (per layer one or two planes of
  `num_blocks` blocks, K|V-first or block-first), taken from `register_kv_caches`' tensors.
- `VllmGrant`: a decode's reservation as the prefill needs it: the decode's transfer engine,
  its geometry, its block ids for the prompt's blocks from `first_block` on, and the nonce a
  ready notify must carry. It crosses processes as JSON (`to_wire`/`from_wire`, which checks
  every field and names the one that is wrong).
- `ready_message`/`parse_ready`: the `kv_ready` notify (request id, nonce, tokens, ok).
- `ConnectorSettings`: the connector's keys of vLLM's `kv_connector_extra_config`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve_common.pod_env import KV_LINK_KEY

READY_NOTIFY = "kv_ready"  # the name pdserve's transfer plane gives the ready notify
GRANT_PARAM = "pdserve_grant"  # the key of a request's kv_transfer_params that carries a grant
RESERVE_PARAM = "pdserve_reserve"  # the key that asks a decode to reserve blocks for a push
MAX_LAYERS = 4096


def _int(data: Mapping[str, Any], key: str, low: int = 0, high: int = 2**63) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"grant field {key!r} must be an integer in [{low}, {high}), got {value!r}")
    return value


def _str(data: Mapping[str, Any], key: str, limit: int = 256) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ValueError(f"grant field {key!r} must be a non-empty string of at most {limit} chars, got {value!r}")
    return value


def _ints(data: Mapping[str, Any], key: str, limit: int) -> tuple[int, ...]:
    value = data.get(key)
    if not isinstance(value, list) or len(value) > limit:
        raise ValueError(f"grant field {key!r} must be a list of at most {limit} integers, got {type(value).__name__}")
    return tuple(_int({key: v}, key) for v in value)


@dataclass(frozen=True)
class KVGeometry:
    """A worker's KV cache: layer i's planes start at `planes[i]`; block b of a plane is
    `block_bytes` at plane + b * `block_stride`. Two planes per layer: vLLM's (2, blocks, ...)
    layout (K then V); one: block-first (each block holds its K and V)."""

    layer_names: tuple[str, ...]
    planes: tuple[tuple[int, ...], ...]
    num_blocks: int
    block_bytes: int
    block_stride: int
    block_tokens: int
    dtype: str

    @classmethod
    def of(cls, kv_caches: Mapping[str, Any], block_tokens: int) -> KVGeometry:
        """From `register_kv_caches`' tensors (torch), in the model's layer order."""
        names, planes, shapes = [], [], set()
        for name, tensor in kv_caches.items():
            if not tensor.is_contiguous():
                raise ValueError(f"KV cache of layer {name!r} is not contiguous (strides {tuple(tensor.stride())})")
            kv_first = tensor.dim() >= 3 and tensor.shape[0] == 2
            split = [tensor[0], tensor[1]] if kv_first else [tensor]
            names.append(name)
            planes.append(tuple(int(p.data_ptr()) for p in split))
            shapes.add((tuple(tensor.shape), str(tensor.dtype), kv_first, split[0][0].nbytes, split[0].stride(0)))
        if len(shapes) != 1:
            raise ValueError(f"KV cache layers differ in shape or dtype: {sorted(shapes)}")
        shape, dtype, kv_first, block_bytes, stride = shapes.pop()
        element = block_bytes // math.prod(shape[2:] if kv_first else shape[1:])
        return cls(
            layer_names=tuple(names),
            planes=tuple(planes),
            num_blocks=shape[1] if kv_first else shape[0],
            block_bytes=block_bytes,
            block_stride=stride * element,
            block_tokens=block_tokens,
            dtype=dtype,
        )

    def check_matches(self, other: KVGeometry) -> None:
        """Raise ValueError naming the first field where a peer's cache cannot take ours."""
        for key in ("layer_names", "block_bytes", "block_tokens", "dtype"):
            if getattr(self, key) != getattr(other, key):
                raise ValueError(
                    f"KV geometry differs in {key}: here {getattr(self, key)!r}, peer {getattr(other, key)!r}"
                )
        if [len(p) for p in self.planes] != [len(p) for p in other.planes]:
            raise ValueError("KV geometry differs in planes per layer (K|V-first against block-first)")

    def block_spans(self, layer: int, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """(address, bytes) of `blocks` of layer `layer`, consecutive blocks merged."""
        spans: list[tuple[int, int]] = []
        for base in self.planes[layer]:
            for block in blocks:
                addr = base + block * self.block_stride
                if spans and spans[-1][0] + spans[-1][1] == addr and self.block_stride == self.block_bytes:
                    spans[-1] = (spans[-1][0], spans[-1][1] + self.block_bytes)
                else:
                    spans.append((addr, self.block_bytes))
        return spans

    def to_wire(self) -> dict[str, Any]:
        data = asdict(self)
        data["layer_names"], data["planes"] = list(self.layer_names), [list(p) for p in self.planes]
        return data

    @classmethod
    def from_wire(cls, data: Any) -> KVGeometry:
        if not isinstance(data, dict):
            raise ValueError(f"grant field 'geometry' must be an object, got {type(data).__name__}")
        names, planes = data.get("layer_names"), data.get("planes")
        if not isinstance(names, list) or not 0 < len(names) <= MAX_LAYERS or not isinstance(planes, list):
            raise ValueError(f"grant geometry needs 1..{MAX_LAYERS} layer_names and planes, got {type(names).__name__}")
        if len(planes) != len(names) or not all(isinstance(p, list) and len(p) in (1, 2) for p in planes):
            raise ValueError(f"grant geometry has {len(planes)} plane lists of 1 or 2 for {len(names)} layers")
        return cls(
            layer_names=tuple(_str({"layer_name": n}, "layer_name") for n in names),
            planes=tuple(_ints({"planes": p}, "planes", 2) for p in planes),
            num_blocks=_int(data, "num_blocks", 1, 2**31),
            block_bytes=_int(data, "block_bytes", 1, 2**40),
            block_stride=_int(data, "block_stride", 1, 2**40),
            block_tokens=_int(data, "block_tokens", 1, 2**20),
            dtype=_str(data, "dtype", 64),
        )


@dataclass(frozen=True)
class VllmGrant:
    """A decode's blocks reserved for one request's pushed KV (module doc)."""

    request_id: str  # the decode's id of the request (the ready notify names it)
    engine_id: str  # the decode's transfer engine, "ip:port"
    nonce: str = ""  # the capability a ready notify must carry (a secret of the request)
    num_tokens: int = 0  # prompt tokens whose KV the decode waits for
    first_block: int = 0  # the decode already holds the blocks before this one (prefix cache)
    block_ids: tuple[int, ...] = ()  # the decode's blocks for prompt blocks first_block, first_block+1, ...
    geometry: KVGeometry | None = None
    tag: str = ""  # the reserving caller's name for the request (the value of pdserve_reserve)

    def describe(self) -> str:
        """For logs and errors (without the nonce)."""
        return f"{self.engine_id} request={self.request_id} blocks={len(self.block_ids)} from={self.first_block}"

    def to_wire(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "engine_id": self.engine_id,
            "nonce": self.nonce,
            "num_tokens": self.num_tokens,
            "first_block": self.first_block,
            "block_ids": list(self.block_ids),
            "geometry": self.geometry.to_wire() if self.geometry is not None else None,
            "tag": self.tag,
        }

    @classmethod
    def from_wire(cls, data: Any) -> VllmGrant:
        if not isinstance(data, dict):
            raise ValueError(f"a grant must be an object, got {type(data).__name__}")
        geometry = KVGeometry.from_wire(data.get("geometry"))
        grant = cls(
            request_id=_str(data, "request_id"),
            engine_id=_str(data, "engine_id", 128),
            nonce=_str(data, "nonce", 128),
            num_tokens=_int(data, "num_tokens", 1, 2**31),
            first_block=_int(data, "first_block", 0, 2**31),
            block_ids=_ints(data, "block_ids", geometry.num_blocks),
            geometry=geometry,
            tag=str(data.get("tag", ""))[:256],
        )
        bad = [b for b in grant.block_ids if b >= geometry.num_blocks]
        if bad:
            raise ValueError(f"grant block ids {bad[:4]} outside the decode's {geometry.num_blocks} blocks")
        needed = -(-grant.num_tokens // geometry.block_tokens) - grant.first_block
        if len(grant.block_ids) != needed:
            raise ValueError(f"grant has {len(grant.block_ids)} blocks, its {grant.num_tokens} tokens need {needed}")
        return grant


def ready_message(request_id: str, nonce: str, num_tokens: int, ok: bool) -> str:
    """The `kv_ready` notify's body: ok False says the push failed (the decode recomputes)."""
    return json.dumps({"request_id": request_id, "nonce": nonce, "num_tokens": num_tokens, "ok": ok})


def parse_ready(text: str) -> tuple[str, str, int, bool]:
    """(request_id, nonce, num_tokens, ok) of a `kv_ready` body; ValueError if malformed."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"ready notify is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("ok"), bool):
        raise ValueError(f"ready notify needs an object with a boolean 'ok', got {text[:80]!r}")
    return _str(data, "request_id"), _str(data, "nonce", 128), _int(data, "num_tokens"), data["ok"]


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's keys in vLLM's `kv_connector_extra_config` (all strings or numbers)."""

    backend: str = "auto"  # pdserve transfer backend: auto | hixl | cpu
    listen: str = ""  # decode: "ip:port" its transfer engine listens on
    link_key: str = ""  # hex, both ends of a link hold it; default $PDSERVE_KV_LINK_KEY (vLLM logs its config)
    grant_sink: str = ""  # decode: "ip:port" that learns each grant (pdserve's decode worker)
    ready_timeout_s: float = 60.0  # decode: a grant without its ready notify is recomputed locally
    push_timeout_s: float = 10.0  # prefill: a put pending longer fails the push
    quarantine_s: float = 0.5  # decode: an abandoned grant's blocks stay unused this long

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        known = set(cls.__dataclass_fields__)
        values = {k.removeprefix("pdserve_"): v for k, v in extra.items() if k.removeprefix("pdserve_") in known}
        try:
            made = cls(**{k: type(getattr(cls, k))(v) for k, v in values.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kv_connector_extra_config: {exc} (got {values})") from None
        if not made.link_key:
            made = cls(**{**made.__dict__, "link_key": os.environ.get(KV_LINK_KEY, "")})
        for key in ("ready_timeout_s", "push_timeout_s", "quarantine_s"):
            if not getattr(made, key) > 0:
                raise ValueError(f"kv_connector_extra_config pdserve_{key} must be > 0, got {getattr(made, key)}")
        return made
