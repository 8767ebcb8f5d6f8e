"""The prefill and decode roles: their counts, their KV and how decode waits for it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from pdserve_operator.spec.base import Rule
from pdserve_operator.spec.pods import PodOverrides


class PrefillSpec(PodOverrides):
    """Prefill workers: compute a prompt's KV and push it into a decode slot."""

    replicas: int = Field(1, ge=0, le=1024, description="Number of prefill pods.")
    layers_per_chunk: int = Field(
        4,
        ge=1,
        le=1024,
        description="Layers computed between two KV pushes (transfer of chunk k overlaps compute of k+1).",
    )
    prefix_cache_tokens: int | None = Field(
        None,
        ge=0,
        le=16_777_216,
        description="Tokens of prompt-prefix KV each prefill pod keeps for reuse (blocks of 16 tokens, LRU): a prompt "
        "whose beginning was seen computes only the rest; a prompt reuses only its own tenant's prefixes. Unset: "
        "a quarter of the pod's memory limit (the worker sizes it at start and logs it). 0: no prefix cache.",
    )
    prefix_disk_gib: int | None = Field(
        None,
        ge=1,
        le=65_536,
        description="A second tier for the prefix cache on the pod's disk: an emptyDir of this many GiB (kept across "
        "container restarts, not across pod deletion) holding every cached block, read back on a hit, checked, LRU. "
        "Unset: RAM only.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel ranks per prefill pod: one process per rank, each holding a share of every "
        "layer's heads (all_reduce inside the pod through the device's collective library) and pushing its own KV "
        "heads to decode; the pod asks for device.count x tensorParallelSize accelerators. Must split the "
        "model's heads (pdserve info --tp N). The prefix cache is off in a tensor-parallel prefill.",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.tensorParallelSize == 1 || !has(self.prefixCacheTokens) || self.prefixCacheTokens == 0",
            message="prefixCacheTokens: the prefix cache is off in a tensor-parallel prefill (tensorParallelSize > 1)",
            holds=lambda p: p.tensor_parallel_size == 1 or not p.prefix_cache_tokens,
            field="prefixCacheTokens",
        ),
        Rule(
            cel="self.tensorParallelSize == 1 || !has(self.prefixDiskGib)",
            message="prefixDiskGib: the prefix cache is off in a tensor-parallel prefill (tensorParallelSize > 1)",
            holds=lambda p: p.tensor_parallel_size == 1 or p.prefix_disk_gib is None,
            field="prefixDiskGib",
        ),
    )


class DecodeSpec(PodOverrides):
    """Decode workers: own the KV pool, wait for readiness, generate tokens."""

    replicas: int = Field(
        1, ge=0, le=1024, description="Number of decode groups (the scale subresource; kubectl scale pdis/NAME)."
    )
    slots: int = Field(
        8,
        ge=1,
        le=4096,
        description="Concurrent requests per decode group. With kvBlockTokens 0 also its KV pool: slots of "
        "model.maxLength tokens each.",
    )
    kv_block_tokens: int = Field(
        16,
        ge=0,
        le=4096,
        description="Tokens per KV block: a request reserves blocks for its prompt plus max_tokens, so capacity is "
        "counted in tokens. 0: one model.maxLength slot per request. A layer-sharded group (layerShards > 1) keeps "
        "slots.",
    )
    kv_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 30,
        description="KV pool size in tokens per decode group with blocks (default slots x model.maxLength: the "
        "memory of the slots, capped by the decode at half its pod's memory limit and logged at start).",
    )
    readiness: Literal["interrupt", "poll", "spin"] = Field(
        "interrupt",
        description="How decode waits for a slot's KV: interrupt (block on the notification), poll (every pollIntervalMicros), spin.",
    )
    poll_interval_micros: int | None = Field(
        None, ge=1, le=1_000_000, description="Poll period with readiness poll (default 100)."
    )
    warmup: bool = Field(
        True,
        description="Touch a slot's KV pages before its first decode step, so it takes no page faults "
        "(device cpu; a no-op elsewhere).",
    )
    layer_shards: int = Field(
        1,
        ge=1,
        le=64,
        description="Pods per decode group, each holding a contiguous share of the layers; the StatefulSet runs replicas x layerShards pods.",
    )
    group_scheduling: Literal["statefulSet", "leaderWorkerSet"] = Field(
        "statefulSet",
        description="What runs the decode pods: statefulSet (one StatefulSet of replicas x layerShards pods) or "
        "leaderWorkerSet (one LeaderWorkerSet of replicas groups of layerShards pods, created, scheduled, restarted "
        "and rolled as a unit; needs the LWS CRD, leaderworkerset.x-k8s.io/v1, and the chart value "
        "leaderWorkerSet.enabled). Changing it replaces every decode pod (docs/gang-scheduling.md).",
    )
    drain_timeout_seconds: int = Field(
        60, ge=0, le=3600, description="How long a stopping decode pod may finish its requests (preStop /drain)."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel ranks per decode pod: one process per rank, each holding a share of every "
        "layer's heads and a KV pool of its own KV heads (the prefill pushes each rank's heads into its pool); the "
        "pod asks for device.count x tensorParallelSize accelerators. Must split the model's heads (pdserve info "
        "--tp N). Needs kvBlockTokens > 0; not with layerShards > 1. Draining, every rank pushes its heads of each "
        "running request to another decode (live migration).",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.pollIntervalMicros) || self.readiness == 'poll'",
            message="pollIntervalMicros is only meaningful with readiness poll",
            holds=lambda d: d.poll_interval_micros is None or d.readiness == "poll",
            field="pollIntervalMicros",
        ),
        Rule(
            cel="self.tensorParallelSize == 1 || self.layerShards == 1",
            message="tensorParallelSize: a decode group is tensor-parallel or layer-sharded (layerShards > 1), not both",
            holds=lambda d: d.tensor_parallel_size == 1 or d.layer_shards == 1,
            field="tensorParallelSize",
        ),
        Rule(
            cel="self.tensorParallelSize == 1 || self.kvBlockTokens > 0",
            message="tensorParallelSize: a tensor-parallel decode needs a paged KV pool (kvBlockTokens > 0)",
            holds=lambda d: d.tensor_parallel_size == 1 or d.kv_block_tokens > 0,
            field="tensorParallelSize",
        ),
        Rule(
            cel="!has(self.kvTokens) || self.kvBlockTokens > 0",
            message="kvTokens is only meaningful with kvBlockTokens > 0 (max-length slots hold slots x maxLength)",
            holds=lambda d: d.kv_tokens is None or d.kv_block_tokens > 0,
            field="kvTokens",
        ),
    )
