"""Which adapters sit in host memory and in the device's slots, both least recently used first."""

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.layers.linear import Linear
from engine.lora.adapter import LoRAAdapter, LoRAError, ModuleLoRA, describe, load_adapter
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRABatch, LoRASlots, LoRATarget

logger = logging.getLogger(__name__)


@dataclass
class LoRAStats:
    """Counters since the engine started: adapters read from disk and dropped from host
    memory, and adapters copied into device slots and evicted from them."""

    num_host_loads: int = 0
    num_host_evictions: int = 0
    num_slot_loads: int = 0
    num_slot_evictions: int = 0


@dataclass
class _AdaptedProjection:
    """One of the model's projections: its adapter slots, and the target of each of its
    shards (q/k/v of a fused projection) by Hugging Face path, whose adapter weights go there."""

    slots: LoRASlots
    shards: list[tuple[str, LoRATarget] | None]


class LoRAManager:
    """Keeps up to `max_cpu_loras` adapters in host memory and `max_loras` in device slots.

    Adapters are read once into host memory and copied into a slot when a step needs
    them, evicting the least recently used of both when full. An adapter's
    `lora_int_id` is its identity for the engine's life: the same id with another folder
    is an error, so the id can key the prefix cache.

    Args:
        targets: Each adaptable projection's Hugging Face path ("model.layers.0.self_attn.
            q_proj") -> its `LoRATarget` (on a tensor-parallel rank, the rank's share).
    """

    def __init__(
        self,
        targets: dict[str, LoRATarget],
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        base_model: str,
    ) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.base_model = base_model
        self.batch = LoRABatch(max_loras)
        self.stats = LoRAStats()
        self._shapes = {path: target.checkpoint_shape for path, target in targets.items()}
        self._projections: list[_AdaptedProjection] = []
        shards: dict[Linear, list[tuple[str, LoRATarget] | None]] = {}
        for path, target in targets.items():
            layer = target.layer
            if layer not in shards:
                sizes = layer.shard_sizes or [layer.out_features]
                shards[layer] = [None] * len(sizes)
                slots = LoRASlots(layer, sizes, max_loras, max_lora_rank, self.batch, dtype, device)
                self._projections.append(_AdaptedProjection(slots, shards[layer]))
            shards[layer][target.shard] = (path, target)
        self._known: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first

    def check(self, request: LoRARequest) -> LoRAAdapter:
        """Reads the adapter into host memory (if it is not there) and checks it.

        Raises:
            LoRAError: a bad id, an id already used by another adapter, or any problem
                `load_adapter` finds.
        """
        if not isinstance(request.lora_int_id, int) or isinstance(request.lora_int_id, bool) or request.lora_int_id < 1:
            raise LoRAError(f"{describe(request)}: lora_int_id must be a positive integer")
        known = self._known.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise LoRAError(f"{describe(request)}: lora_int_id {request.lora_int_id} already names "
                            f"{known.lora_path}; give each adapter its own lora_int_id")
        return self._host_adapter(request)

    def _host_adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(request.lora_int_id)
        if adapter is not None:
            self._host.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self._shapes, self.max_lora_rank, self.dtype, self.base_model)
        self._known[request.lora_int_id] = request
        self.stats.num_host_loads += 1
        if len(self._host) >= self.max_cpu_loras:
            self._host.popitem(last=False)
            self.stats.num_host_evictions += 1
        self._host[request.lora_int_id] = adapter
        return adapter

    def activate(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Puts the step's adapters into slots; returns each one's slot by lora_int_id.

        The scheduler admits at most `max_loras` distinct adapters at once, so a slot whose
        adapter this step does not use is always there to evict.
        """
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} adapters but there are {self.max_loras} slots")
        for lora_id, request in wanted.items():
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            if len(self._slot_of) < self.max_loras:
                slot = len(self._slot_of)
            else:
                victim = next(i for i in self._slot_of if i not in wanted)
                slot = self._slot_of.pop(victim)
                self.stats.num_slot_evictions += 1
            self._load_slot(slot, self._host_adapter(request))
            self._slot_of[lora_id] = slot
        return {lora_id: self._slot_of[lora_id] for lora_id in wanted}

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for projection in self._projections:
            projection.slots.load(slot, [_local_lora(adapter, shard) for shard in projection.shards])
        self.stats.num_slot_loads += 1
        logger.debug("LoRA adapter %r in slot %d", adapter.request.lora_name, slot)


def _local_lora(adapter: LoRAAdapter, shard: tuple[str, LoRATarget] | None) -> ModuleLoRA | None:
    """The adapter's matrices for one shard of a projection, as this rank holds it."""
    if shard is None:
        return None
    path, target = shard
    lora = adapter.modules.get(path)
    return None if lora is None else target.local(lora)
