"""How and where the model is computed: `ExecConfig` (kernel, block sizes, remat, scan, dtype,
the MoE path) and `MeshConfig`; free to change between runs of the same checkpoint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gattn.config.checks import (ACCUMULATE, ATTENTION_IMPLS, DTYPES, GDN_IMPLS, GROUPED_MATMULS, MOE_IMPLS,
                                 REMAT_POLICIES, ConfigError, _bool, _choice, _integer)


@dataclass(frozen=True)
class ExecConfig:
    """How the model is computed, not what it is: free to change on resume, in eval and when moving
    to another machine (the checkpoint's parameters do not depend on any of it).

    dtype:            compute dtype of activations and matmul inputs (parameters keep model.param_dtype).
    scan_layers:      one jax.lax.scan over stacked blocks (fast compiles for deep models) instead
                      of a Python loop; a hybrid scans over groups of its repeating layer pattern
                      (model.layer_period layers each); checkpoints convert between the layouts
                      on restore.
    remat:            what each block's forward pass keeps for the backward pass; the rest is
                      recomputed there (docs/performance.md, "Rematerialisation"). none:
                      everything; full: only the block's input; dots / dots_no_batch: every
                      matmul's output (with or without batch dimensions); named activations
                      (MaxText's remat_policy, gattn/model/transformer.py SAVED_NAMES):
                      qkv_proj: the q, k, v and gate projections; save_attn_out: the attention's
                      output and the projections' inputs (attn_in, attn_out, out_proj, mlp_in);
                      minimal: all but the SDPA's internals and the FFN's hidden (qkv_proj +
                      attn_out, out_proj, mlp_in, mlpwo); qkv_proj_offloaded, minimal_offloaded:
                      the same saved in the host's pinned memory instead of HBM.
    attention_impl:   xla (the plain jnp reference) or pallas (the fused flash kernel with the gate;
                      compiled by Mosaic on TPU, interpret mode elsewhere, ~100x slower);
                      pallas_gpu (the fused kernel for GPUs, Triton; interpret mode elsewhere);
                      cudnn (cuDNN attention, gate applied after it); auto (TPU -> pallas,
                      GPU -> kernels.GPU_DEFAULT, untimed on a GPU: docs/gpu.md; else xla).
    attention_block_q: causal query block of the xla path (0 = no blocking).
    attention_query_chunk: > 0: the xla path runs queries this many at a time in a loop
                      (memory O(chunk * S) per layer; long contexts on CPU).
    flash_block_q, flash_block_k: query / key blocks of the pallas kernel (multiples of 8; TPU
                      wants multiples of 128).
    moe_impl:         partitioned: the MoE layer is one program that XLA's partitioner splits over
                      the mesh (dropless or with a capacity counted over the whole batch);
                      all_to_all: tokens exchanged explicitly over the mesh's expert axis inside
                      shard_map (needs model.moe.capacity_factor and mesh.expert > 1 dividing the
                      experts; capacity is counted per data x expert shard); ragged: dropless
                      expert parallelism, only the routed rows exchanged with ragged_all_to_all
                      and grouped matmuls (needs a dropless MoE, capacity_factor None, and
                      mesh.expert > 1 dividing the experts; gattn/model/dropless_ep.py). Chosen
                      here, never by whatever mesh happens to be set.
    moe_buffer:       ragged only: rows each device's experts can receive, as a multiple of the
                      rows one shard routes (N_local * k). None = the worst case, every row of
                      every shard of the expert group (mesh.expert x), so nothing can overflow; a
                      smaller value (>= 1) saves memory and compute, and rows past it are dropped
                      and counted (moe/dropped), never silently.
    grouped_matmul:   ragged only: the local experts' grouped matmul, ragged_dot (jax.lax.ragged_dot)
                      or megablox (the Pallas TPU kernel jax ships, gmm forward and gmm + tgmm
                      backward; interpret mode on CPU, slow). docs/moe-and-mesh.md.
    loss_chunk:       > 0: the training loss and validation compute the LM head's logits this many
                      sequence positions of every row at a time, each chunk recomputed in the
                      backward pass, so the [rows, S, V] float32 logits never exist (memory
                      rows x loss_chunk x V per chunk); 0 = all at once. Same values.
                      docs/performance.md.
    gdn_chunk:        hybrid models: tokens per chunk of the Gated DeltaNet's chunked rule
                      (memory B x H x S x gdn_chunk per intermediate; the same function for any
                      value, docs/hybrid.md).
    gdn_impl:         hybrid models: how the Gated DeltaNet's chunked rule runs: xla (the jnp scan,
                      the reference), pallas (the Pallas kernel, forward and backward, float32
                      state; compiled by Mosaic on TPU, interpret mode elsewhere, ~100x slower;
                      gdn_chunk a multiple of 8), auto (TPU -> pallas, else xla). docs/hybrid.md.
    accumulate:       train.microbatches > 1 on an fsdp axis > 1: sharded (ZeRO-3, as MaxText)
                      gathers each layer's weights and reduce-scatters its gradient in every
                      microbatch: the least memory, bytes sent x microbatches; gathered (ZeRO-2)
                      gathers the weights once per step and each fsdp shard sums its own rows'
                      gradients over the microbatches, whole and in float32, reduce-scattered
                      once after them: the bytes do not grow with the microbatches, at the cost
                      of the whole parameters and a whole float32 gradient per chip. The same
                      update either way. Not for a MoE (its global-batch LBL counts every
                      shard's tokens). docs/training.md#microbatches.
    """

    dtype: str = "float32"
    scan_layers: bool = False
    remat: str = "none"
    attention_impl: str = "xla"
    attention_block_q: int = 128
    attention_query_chunk: int = 0
    flash_block_q: int = 512
    flash_block_k: int = 512
    moe_impl: str = "partitioned"
    moe_buffer: float | None = None
    grouped_matmul: str = "ragged_dot"
    loss_chunk: int = 0
    gdn_chunk: int = 64
    gdn_impl: str = "xla"
    accumulate: str = "sharded"

    def __post_init__(self):
        _choice("dtype", self.dtype, DTYPES)
        _bool("scan_layers", self.scan_layers)
        _choice("remat", self.remat, REMAT_POLICIES)
        _choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _choice("moe_impl", self.moe_impl, MOE_IMPLS)
        if self.moe_buffer is not None and not (isinstance(self.moe_buffer, (int, float))
                                                and not isinstance(self.moe_buffer, bool)
                                                and self.moe_buffer >= 1):
            raise ConfigError("moe_buffer", self.moe_buffer, "expected None (the worst case) or a number >= 1")
        _choice("grouped_matmul", self.grouped_matmul, GROUPED_MATMULS)
        if self.grouped_matmul != "ragged_dot" and self.moe_impl != "ragged":
            raise ConfigError("grouped_matmul", self.grouped_matmul, "megablox runs in the ragged MoE path only: "
                              f"set moe_impl='ragged' (now {self.moe_impl!r}) or keep 'ragged_dot'")
        _integer("attention_block_q", self.attention_block_q, zero_ok=True)
        _integer("attention_query_chunk", self.attention_query_chunk, zero_ok=True)
        _integer("loss_chunk", self.loss_chunk, zero_ok=True)
        _integer("gdn_chunk", self.gdn_chunk)
        _choice("gdn_impl", self.gdn_impl, GDN_IMPLS)
        if self.gdn_impl != "xla" and self.gdn_chunk % 8:
            raise ConfigError("gdn_chunk", self.gdn_chunk, f"a multiple of 8 with gdn_impl={self.gdn_impl!r} "
                              "(the kernel's chunk is a block of rows)")
        _choice("accumulate", self.accumulate, ACCUMULATE)
        for name in ("flash_block_q", "flash_block_k"):
            _integer(name, getattr(self, name))
            if getattr(self, name) % 8:
                raise ConfigError(name, getattr(self, name), "expected a positive multiple of 8")


# Fields that lived in ModelConfig before the architecture / execution split: a run's older
# config.json and `--config.model.FIELD=...` overrides are read as `exec.FIELD`.
MOVED_TO_EXEC = tuple(f.name for f in dataclasses.fields(ExecConfig))


MESH_AXES = ("data", "fsdp", "context", "expert", "model")  # the device mesh's axes, outermost first
BATCH_AXES = ("data", "fsdp", "expert")  # the axes a batch's rows are split over


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes (gattn/model/sharding.py): data parallel, expert parallel, model (tensor)
    parallel, fsdp: data parallel with the parameters, their gradients and the optimizer
    state sharded over it too (gathered layer by layer), and context: each row's sequence split
    over it, in a load-balanced causal layout (gattn/model/context.py; the parameters are split
    over it as over fsdp). Their product is the device count; one of data and fsdp may be -1,
    taking what the others leave."""

    data: int = -1
    expert: int = 1
    model: int = 1
    fsdp: int = 1
    context: int = 1  # context parallelism: the sequence split over this axis (gattn/model/context.py)

    def __post_init__(self):
        for name in ("data", "fsdp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
                raise ConfigError(name, value, "expected a positive integer or -1 (all remaining devices)")
        if self.data == -1 and self.fsdp == -1:
            raise ConfigError("fsdp", self.fsdp, "a positive integer when data is -1 (one axis takes the devices "
                              "the others leave): set data=1 to shard everything over fsdp")
        _integer("expert", self.expert)
        _integer("model", self.model)
        _integer("context", self.context)
