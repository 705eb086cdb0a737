"""Static per-slot KV cache: one [slots, Hkv, T, D] buffer per layer for K and for V.

Decision: per-slot static buffers, not paged blocks. RL rollouts have a known max length (prompt + response),
so a slot of T columns wastes nothing that paging would save on the decode read (decode reads all T columns
under a validity mask either way), while fixed addresses and shapes are what CUDA graphs need and the decode
attention becomes a single SDPA call. Prefix sharing for n samples = copying the prompt's K/V into n slots
once at prefill (the prompt is computed once). There is no block size to configure.
"""

from __future__ import annotations

import logging

import torch

from hybridflow.rollout.weights import ArchSpec

logger = logging.getLogger(__name__)


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def bytes_per_slot(spec: ArchSpec, max_len: int, dtype: torch.dtype) -> int:
    return 2 * spec.num_layers * spec.num_kv_heads * max_len * spec.head_dim * torch.empty(0, dtype=dtype).element_size()


def plan_slots(spec: ArchSpec, max_len: int, dtype: torch.dtype, device: torch.device, *, max_num_seqs: int,
               kv_cache_tokens: int | None, gpu_memory_utilization: float) -> int:
    """How many sequences fit: min(max_num_seqs, budget / bytes per slot).

    Budget: `kv_cache_tokens` × bytes per token when set; else on CUDA `gpu_memory_utilization` × free memory;
    else (CPU) max_num_seqs.
    """
    per_slot = bytes_per_slot(spec, max_len, dtype)
    if kv_cache_tokens is not None:
        fit = kv_cache_tokens // max_len
        where = f"rollout.kv_cache_tokens={kv_cache_tokens}"
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        fit = int(free * gpu_memory_utilization) // per_slot
        where = f"rollout.gpu_memory_utilization={gpu_memory_utilization} of {free / 2**30:.1f} GiB free"
    else:
        return max_num_seqs
    if fit < 1:
        raise ValueError(f"{where} holds no sequence of {max_len} tokens ({per_slot / 2**20:.1f} MiB each); "
                         "raise it or lower data.max_prompt_length / data.max_response_length")
    slots = min(max_num_seqs, fit)
    if slots < max_num_seqs:
        logger.warning("KV cache: %s fits %d sequences < rollout.max_num_seqs=%d", where, slots, max_num_seqs)
    return slots


class KVCache:
    """K and V per layer: [slots, Hkv, T, D]; T rounded up to a multiple of 16 (aligned SDPA masks)."""

    def __init__(self, spec: ArchSpec, slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slots, self.max_len = slots, round_up(max_len, 16)
        shape = (slots, spec.num_kv_heads, self.max_len, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        logger.debug("KV cache: %d slots x %d tokens, %.1f MiB", slots, self.max_len, self.nbytes() / 2**20)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write_prompt(self, layer: int, k_BHPD: torch.Tensor, v_BHPD: torch.Tensor, slots_M: torch.Tensor,
                     src_M: torch.Tensor) -> None:
        """Copy prompt src[m]'s K/V (columns 0..P-1) into slot slots[m]: n samples share one prefill."""
        P = k_BHPD.shape[2]
        self.k[layer][slots_M, :, :P] = k_BHPD[src_M]
        self.v[layer][slots_M, :, :P] = v_BHPD[src_M]
