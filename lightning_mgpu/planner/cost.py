"""The cost model: memory per GPU and step time of one layout, from a model, a cluster and the training setup.

Memory follows Korthikanti et al. (2022) for activations (per layer, by checkpointing, tensor and sequence
parallelism, and the microbatches a pipeline schedule keeps in flight) and the ZeRO paper for parameters,
gradients and optimizer states. Time follows Narayanan et al. (2021): the transformer's FLOPs at an achieved
fraction of peak, plus the elementwise work at HBM speed, tensor-parallel collectives on the links the group
spans, pipeline sends and bubble per schedule, data-parallel gradient traffic (partly hidden behind backward)
and ZeRO-3's parameter gathers.

Small models on CPU processes are bound by fixed costs instead, which ``plan --calibrate`` measures into the
:class:`Efficiency` (0 for GPUs): operator dispatch per block and microbatch, what DTensor adds under tensor
parallelism, what FSDP2 adds per collective, what a pipeline schedule spends per microbatch, the optimizer step;
and processes that outnumber the cores (with other jobs' load) slow every part down (``ClusterSpec.contention``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from lightning_mgpu.parallel import pipeline
from lightning_mgpu.planner.cluster import GB, ClusterSpec, Efficiency
from lightning_mgpu.planner.job import DP_BUCKET_BYTES, PRECISIONS, Layout, Training
from lightning_mgpu.planner.model_spec import ModelSpec


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, float]  # bytes per GPU on the fullest stage, by kind, and "total"
    time: dict[str, float]  # seconds per step, by kind, and "step"
    tokens_per_s: float
    tflops_per_gpu: float  # FLOPs run (recomputation included, as Megatron-LM's Table 1 counts) per second per GPU
    mfu: float  # model FLOPs (3x forward, no recomputation) over peak
    bubble: float
    fits: bool
    problems: list[str] = field(default_factory=list)
    scaling_efficiency: float = float("nan")

    def as_dict(self) -> dict[str, object]:  # for JSON
        result = asdict(self) | {"layout": self.layout.as_dict()}
        if result["scaling_efficiency"] != result["scaling_efficiency"]:  # NaN (not computed) is not JSON
            result["scaling_efficiency"] = None
        return result


def _ring(size: int, nbytes: float, bandwidth: float, eff: Efficiency) -> float:
    """Seconds for an all-reduce of ``nbytes`` over ``size`` ranks (ring: 2(n-1)/n of the data per link)."""
    if size <= 1:
        return 0.0
    return 2 * (size - 1) / size * nbytes / (bandwidth * GB * eff.comm) + 2 * eff.latency_s * math.log2(size)


def _spans_nodes(inner: int, size: int, cluster: ClusterSpec) -> bool:
    """Whether a group of ``size`` ranks ``inner`` apart (mesh (pp, dp, tp), tp innermost) leaves a node."""
    return size > 1 and inner * size > cluster.gpus_per_node


def _bandwidth(inner: int, size: int, cluster: ClusterSpec) -> float:
    return cluster.inter_node_gbps if _spans_nodes(inner, size, cluster) else cluster.intra_node_gbps


def activation_bytes_per_layer(model: ModelSpec, training: Training, layout: Layout, checkpointing: str) -> float:
    """Korthikanti et al. (2022), eq. 1-6, for one block and one microbatch, generalised to GQA, any FFN width,
    gated MLPs and 32-bit activations. With flash attention the ``5 a s^2 b`` score terms vanish. Context
    parallelism holds ``s / cp`` tokens per rank (and ``1/cp`` of the scores)."""
    s, b, h, t = model.seq_len // layout.cp, layout.microbatching.size, model.hidden, layout.tp
    scale = PRECISIONS[training.precision][3] / 2
    sp = layout.options.sequence_parallel and t > 1
    if checkpointing == "full":
        return scale * 2 * s * b * h / (t if sp else 1)
    replicated = 10 * s * b * h  # norm inputs, the q/k/v and MLP inputs, two dropout masks
    # MLP inner activations; in a MoE block, those of each token's routed experts, whole on every tensor-parallel
    # rank under expert parallelism (the tensor plan leaves the experts out).
    mlp = (8 if model.gated_mlp else 4) * s * b * model.expert_ffn * (model.experts_per_token or 1)
    whole = mlp if layout.ep > 1 and model.expert_params else 0.0
    split = (4 * h + 4 * model.kv_dim) * s * b + mlp - whole  # q, k, v, attention output (and the MLP)
    eager = not training.flash_attention and checkpointing != "selective"
    scores = 5 * model.heads * s * s * b * layout.cp if eager else 0.0  # local queries x all keys
    return scale * (replicated / (t if sp else 1) + (split + scores) / t + whole)


def in_flight(layout: Layout) -> float:
    """Microbatches whose activations the first (fullest) rank holds at once, in units of its layers: what torch's
    schedules' action lists give (``parallel.pipeline.timeline``, compared in the tests): every microbatch for the
    all-forward-first schedules, one per stage for the 1F1B kinds, interleaving's warm-up on top, and DualPipeV's
    overlapped forward."""
    p, m, v = layout.pp, layout.microbatching.count, layout.stages_per_rank
    if p == 1:
        return 1.0
    if layout.options.pipeline_schedule in ("GPipe", "LoopedBFS"):
        return float(m)
    if layout.options.pipeline_schedule == "Interleaved1F1B":
        return min(float(m), p + (p - 1) / v)
    if layout.options.pipeline_schedule == "DualPipeV":
        return min(m, p) + 1 / v
    return float(min(m, p))  # 1F1B, InterleavedZeroBubble, ZBVZeroBubble


def bubble_fraction(layout: Layout) -> float:
    return pipeline.bubble_fraction(layout.pp, layout.microbatching.count, layout.stages_per_rank)


def block_params(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """One block's parameters on one GPU before ZeRO: ``(dense, routed experts)``.

    Tensor parallelism shards the matmul weights (norms, routers and row-wise biases stay whole). Routed experts
    are split by expert over ``ep`` (whole on every tensor-parallel rank: the tensor plan leaves them out), or, at
    ``ep`` 1, by tensor parallelism as the rest.
    """
    t = layout.tp
    dense = model.params_per_layer - model.expert_params
    split = min(model.dense_matmul_params_per_layer, dense)
    return split / t + (dense - split), model.expert_params / (layout.ep if layout.ep > 1 else t)


def stage_params(model: ModelSpec, layout: Layout) -> dict[str, tuple[float, float]]:
    """Parameters one GPU holds before ZeRO, ``(dense, routed experts)``, per pipeline stage kind: ``only`` at
    pp=1; ``first``, ``last`` and (pp > 2) ``middle`` with a pipeline.

    The token embedding and the head are sharded over the vocabulary with sequence parallelism (as this library's
    plans do; without it they stay replicated), or always where the model's own plan does
    (``ModelSpec.vocab_parallel``: Hugging Face models with an untied head).
    """
    t = layout.tp
    vocab_t = t if layout.options.sequence_parallel or model.vocab_parallel else 1
    dense, experts = block_params(model, layout)
    token = model.vocab * model.hidden
    first = min(token, model.first_stage_params) / vocab_t + max(0, model.first_stage_params - token)
    if model.tied_embeddings:  # the head is the embedding: a second copy only on a separate last stage
        head, copy = 0, (token if layout.pp > 1 else 0)
    else:
        head, copy = min(token, model.last_stage_params), 0
    last = (head + copy) / vocab_t + (model.last_stage_params - head)
    if layout.pp == 1:
        return {"only": (model.layers * dense + first + last, model.layers * experts)}
    layers = math.ceil(model.layers / layout.pp)
    stages = {"first": (layers * dense + first, layers * experts), "last": (layers * dense + last, layers * experts)}
    if layout.pp > 2:
        stages["middle"] = (layers * dense, layers * experts)
    return stages


def local_params(model: ModelSpec, layout: Layout) -> dict[str, float]:
    """Parameters one GPU holds before ZeRO, per pipeline stage kind (see :func:`stage_params`)."""
    return {stage: dense + experts for stage, (dense, experts) in stage_params(model, layout).items()}


STATE_KINDS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")


def state_bytes(model: ModelSpec, training: Training, layout: Layout) -> dict[str, dict[str, float]]:
    """Parameter, gradient and optimizer-state bytes on the fullest GPU, per pipeline stage kind, after ZeRO.

    ZeRO-1 shards optimizer states, ZeRO-2 (FSDP2 here) and 3 parameters and gradients too, over ``layout.shard``
    ranks. Routed experts under expert parallelism are sharded evenly over their ``dp / ep`` replicas at every
    stage (their own FSDP2 wrap), except at ZeRO 0-1 under a pipeline, where they are replicated; without expert
    parallelism they are sharded with the rest, a fused ``[experts, ...]`` weight by whole experts.
    """
    p_bytes, g_bytes, o_bytes, _ = PRECISIONS[training.precision]
    zero, shard = layout.zero_stage, layout.shard
    if layout.ep > 1:  # sharded evenly within the experts (parallel.experts: their second dimension)
        expert_ranks = 1 if layout.pp > 1 and zero <= 1 else layout.expert_replicas
        expert_states = expert_optimizer = 1 / expert_ranks
    else:
        expert_states = _expert_share(model, layout, shard) if zero >= 2 else 1.0
        expert_optimizer = expert_states if zero >= 2 else 1 / shard if zero == 1 else 1.0
    result = {}
    for stage, (dense, experts) in stage_params(model, layout).items():
        sharded = dense / (shard if zero >= 2 else 1) + experts * expert_states
        result[stage] = {
            "parameter_bytes": sharded * p_bytes,
            "gradient_bytes": sharded * g_bytes,
            "optimizer_bytes": (dense / (shard if zero >= 1 else 1) + experts * expert_optimizer) * o_bytes,
        }
    return result


def _expert_share(model: ModelSpec, layout: Layout, ranks: int) -> float:
    """The share of a GPU's routed-expert weights that the fullest of ``ranks`` FSDP2 shards of the data-parallel
    wrap holds. FSDP2 splits a weight's first dimension in chunks of ``ceil(rows / ranks)``: a fused ``[experts,
    ...]`` weight by whole experts, so 8 experts over 32 ranks stay whole on the first 8 (the others hold none)."""
    if ranks <= 1:
        return 1.0
    if not model.fused_experts or not model.experts:
        return 1 / ranks
    rows = max(1, model.experts // layout.ep)
    return math.ceil(rows / ranks) / rows


def memory(model: ModelSpec, cluster: ClusterSpec, training: Training, layout: Layout) -> dict[str, float]:
    """Bytes per GPU on the fullest pipeline stage (the first or the last), by kind."""
    p_bytes, g_bytes, _, a_bytes = PRECISIONS[training.precision]
    t, d, z = layout.tp, layout.shard, layout.zero_stage  # ZeRO divides by the ranks it shards over
    layers = math.ceil(model.layers / layout.pp)
    s, b, h = model.seq_len // layout.cp, layout.microbatching.size, model.hidden
    per_layer = activation_bytes_per_layer(model, training, layout, layout.recomputation)
    worst: dict[str, float] = {}
    states = state_bytes(model, training, layout)
    for stage, local in local_params(model, layout).items():
        params, grads, optimizer = (states[stage][kind] for kind in STATE_KINDS)
        inflight = in_flight(layout) if stage != "last" else 1.0
        activations = per_layer * layers * inflight
        if stage in ("first", "only"):
            embedding_output = inflight * a_bytes * s * b * h
            activations += embedding_output / (t if layout.options.sequence_parallel else 1)
        temporary = 0.0
        if stage in ("last", "only"):
            temporary += 2 * 4 * s * b * model.vocab / t  # fp32 logits and their gradient in the loss
        if layout.recomputation == "full":  # the block being recomputed holds its full activations
            temporary += activation_bytes_per_layer(model, training, layout, "none")
        elif layout.recomputation == "selective" and not training.flash_attention:  # one block's scores, recomputed
            temporary += activation_bytes_per_layer(model, training, layout, "none") - activation_bytes_per_layer(
                model, training, layout, "selective"
            )
        if z == 2 and d > 1:  # FSDP2 keeps the stage's parameters gathered from forward to backward
            temporary += local * p_bytes * (1 - 1 / d)
        if z == 3 and d > 1:  # one block gathered, the next prefetched, and one block's unsharded gradients
            temporary += sum(block_params(model, layout)) * (2 * p_bytes + g_bytes)
        if layout.ep > 1 and z <= 2 and not (layout.pp > 1 and z <= 1):  # experts gathered from forward to backward
            experts = stage_params(model, layout)[stage][1]
            temporary += experts * p_bytes * (1 - 1 / layout.expert_replicas)
        if z <= 1 and layout.gradient_ranks > 1:
            temporary += 2 * DP_BUCKET_BYTES
        step_temp = local * 4 / (d if z >= 1 else 1)  # foreach Adam's intermediate of the local states
        total = params + grads + optimizer + max(activations + temporary, step_temp)
        if not worst or total > worst["total"]:
            worst = {
                "params": params,
                "grads": grads,
                "optimizer": optimizer,
                "activations": activations,
                "temporary": max(temporary, step_temp - activations),
                "total": total,
            }
    return worst


def step_time(
    model: ModelSpec, cluster: ClusterSpec, training: Training, layout: Layout, eff: Efficiency
) -> dict[str, float]:
    """Seconds per optimizer step, by kind; ``step`` is the total the GPUs wait for."""
    t, p, d, m, v = layout.tp, layout.pp, layout.gradient_ranks, layout.microbatching.count, layout.stages_per_rank
    p_bytes, g_bytes, _, a_bytes = PRECISIONS[training.precision]
    s, b, h = model.seq_len, layout.microbatching.size, model.hidden
    tokens = s * b // layout.cp  # this rank's share of each microbatch's tokens
    block_flops, head_flops = model.forward_flops_per_token()
    ckpt = layout.recomputation
    passes = 4 if ckpt == "full" else 3  # forward, backward = 2 forwards, and the forward again when recomputing
    peak = cluster.peak_flops(training.precision) * eff.gemm
    hbm = cluster.hbm_gbps * GB
    # One block, one microbatch, on one GPU of the tensor-parallel group.
    # Routed experts under expert parallelism run whole on every tensor-parallel rank.
    whole = model.routed_flops_per_token() if layout.ep > 1 else 0.0
    flops = passes * ((block_flops - whole) / t + whole) * tokens
    if ckpt == "selective" and not training.flash_attention:
        flops += 4.0 * s * h * tokens / t  # the attention scores, recomputed
    moved = activation_bytes_per_layer(model, training, layout, "none") * eff.memory_passes * passes
    block_compute = flops / peak + moved / hbm + eff.layer_overhead_s
    collectives = {"none": 4, "selective": 4, "full": 6}[ckpt]  # 2 all-reduces forward (+2 recompute), 2 backward
    tp_bw = _bandwidth(1, t, cluster)
    block_tp = collectives * _ring(t, a_bytes * tokens * h, tp_bw, eff) + (eff.tp_layer_overhead_s if t > 1 else 0.0)
    layers = math.ceil(model.layers / p)
    head = 3 * head_flops * tokens / t / peak + eff.memory_passes * 3 * 4 * tokens * model.vocab / t / hbm
    head += eff.layer_overhead_s  # the embedding's and the head's dispatch: one more block's
    # ZeRO-3 gathers each block's parameters in forward and backward and reduce-scatters its gradients per microbatch
    # over the shard group; under HSDP the reduced shards are then all-reduced across the replicas.
    dp_bw = _bandwidth(t, d, cluster)
    k, r = layout.shard, layout.replicas
    shard_bw, replica_bw = _bandwidth(t, k, cluster), _bandwidth(t * k, r, cluster)
    zero3 = zero3_root = 0.0
    collective = eff.latency_s + eff.shard_collective_s  # one FSDP2 all-gather or reduce-scatter, data aside
    if layout.zero_stage == 3 and d > 1:
        block_bytes = sum(block_params(model, layout))
        zero3 = (2 * block_bytes * p_bytes + block_bytes * g_bytes) * (k - 1) / k / (shard_bw * GB * eff.comm)
        zero3 += 3 * collective  # two gathers and one reduce-scatter per block
        zero3 += _ring(r, block_bytes * g_bytes / k, replica_bw, eff) + (collective if r > 1 else 0.0)
        zero3 = max(zero3 - eff.dp_overlap * block_compute, (1 - eff.dp_overlap) * zero3)
        zero3_root = 3 * collective * (1 - eff.dp_overlap)  # the root's wrap: embedding, head, final norm
    block_cp = context_parallel_time(model, cluster, training, layout, eff, block_compute)
    block_ep = expert_parallel_time(model, cluster, training, layout, eff)
    # The last stage: it runs the head.
    stage = layers * (block_compute + block_tp + block_cp + block_ep + zero3) + head + zero3_root
    p2p = 0.0
    if p > 1:
        pp_bw = _bandwidth(t * d, p, cluster)
        send = a_bytes * tokens * h / t / (pp_bw * GB * eff.comm) + eff.latency_s
        p2p = 2 * v * send + v * eff.microbatch_overhead_s  # one activation forward, one gradient backward
    per_microbatch = stage + p2p
    pipeline = (m + (p - 1) / v) * per_microbatch
    # Data-parallel gradient traffic, hidden behind the last microbatch's backward as far as it overlaps.
    stage_params = max(local_params(model, layout).values())
    # This library replicates with DDP only plain parameters outside a pipeline; otherwise FSDP2 wraps every block
    # (ZeRO-2 outside a pipeline: consecutive blocks of a bucket's size) and the root, parameters become DTensors.
    fsdp = d > 1 and (layout.zero_stage >= 2 or p > 1 or t > 1)
    dp = 0.0
    if d > 1 and layout.zero_stage < 3:
        nbytes = stage_params * g_bytes if layout.zero_stage == 0 else stage_params * (g_bytes + p_bytes) / 2
        dp = _ring(d, nbytes, dp_bw, eff)
        if layout.zero_stage == 2 and r > 1:  # HSDP: reduce-scatter and gather in the shard group, all-reduce across
            dp = stage_params * (g_bytes + p_bytes) * (k - 1) / k / (shard_bw * GB * eff.comm)
            dp += _ring(r, stage_params * g_bytes / k, replica_bw, eff)
        elif layout.zero_stage == 1 and r > 1:  # all-reduce over dp, the owners' broadcast in the shard group
            dp = _ring(d, stage_params * g_bytes, dp_bw, eff)
            dp += stage_params * p_bytes * (k - 1) / k / (shard_bw * GB * eff.comm)
        if layout.zero_stage == 2:  # FSDP2 gathers the parameters once more at the start of the step
            dp += stage_params * p_bytes * (k - 1) / k / (shard_bw * GB * eff.comm)
            units = layers + 1 if p > 1 else stage_params * p_bytes // DP_BUCKET_BYTES + 1
            dp += 2 * units * collective  # one gather and one reduce-scatter per unit
        elif fsdp:
            dp += (layers + 1) * collective  # one all-reduce per block and the root
        else:
            dp += math.ceil(nbytes / DP_BUCKET_BYTES) * eff.latency_s  # one all-reduce per bucket
        window = stage * 2 / passes
        dp = dp - eff.dp_overlap * min(dp, window)
    shards = k if layout.zero_stage >= 1 else 1
    optimizer = stage_params / shards * (p_bytes + g_bytes + 16 + 4 + 8) / hbm  # read p, g, m, v; write p, m, v
    optimizer += eff.step_overhead_s
    if t > 1 or fsdp:  # the parameters are DTensors
        optimizer += eff.sharded_step_overhead_s
    compute_only = m * layers * block_compute + m * head
    times = {
        "compute": compute_only,
        "tensor_parallel": m * layers * block_tp,
        "context_parallel": m * layers * block_cp,
        "expert_parallel": m * layers * block_ep,
        "zero3_gather": m * (layers * zero3 + zero3_root),
        "pipeline_p2p": (m + (p - 1) / v) * p2p,
        "bubble": pipeline - m * per_microbatch,
        "data_parallel": dp,
        "optimizer": optimizer,
        "step": pipeline + dp + optimizer,
    }
    # Processes beyond the cores share them (CPU): every part of the step, collectives included, runs that much slower.
    return {kind: seconds * cluster.contention for kind, seconds in times.items()}


def expert_parallel_bytes(model: ModelSpec, training: Training, layout: Layout) -> float:
    """Bytes one rank sends per MoE block and microbatch for expert parallelism: each of its tokens' routed copies
    (``experts_per_token``) goes to the rank holding the expert and back, forward and backward (four all-to-alls),
    ``(ep - 1) / ep`` of them off the rank (balanced routing)."""
    if layout.ep == 1 or not model.expert_params:
        return 0.0
    tokens = model.seq_len // layout.cp * layout.microbatching.size
    copies = tokens * (model.experts_per_token or 1) * model.hidden * PRECISIONS[training.precision][3]
    return 4 * copies * (layout.ep - 1) / layout.ep


def expert_parallel_time(
    model: ModelSpec, cluster: ClusterSpec, training: Training, layout: Layout, eff: Efficiency
) -> float:
    """Seconds of one MoE block's all-to-alls (one microbatch), not hidden: the experts wait for their tokens.
    An ``ep`` group is ``ep`` consecutive data-parallel ranks, ``tp`` ranks apart."""
    sent = expert_parallel_bytes(model, training, layout)
    if not sent:
        return 0.0
    return sent / (_bandwidth(layout.tp, layout.ep, cluster) * GB * eff.comm) + 4 * eff.latency_s


def context_parallel_bytes(
    model: ModelSpec, training: Training, layout: Layout, bytes_per_value: int | None = None
) -> dict[str, float]:
    """Bytes one rank sends per block and microbatch for context parallelism, forward and backward.

    Ring: the key/value block (``K_local + V_local`` bytes, this rank's ``s/cp`` tokens of the local heads) travels
    ``cp - 1`` hops forward; backward sends it ``cp - 1`` hops again and its fp32 gradients ``cp`` hops (the last
    one home). All-to-all: q, k, v and the output are each exchanged once ((cp-1)/cp of them) forward, and their
    gradients once backward.
    """
    cp = layout.cp
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0}
    value = PRECISIONS[training.precision][3] if bytes_per_value is None else bytes_per_value
    tokens = model.seq_len // cp * layout.microbatching.size
    kv_values = 2 * tokens * model.kv_dim / layout.tp
    if layout.options.context_parallel_mode == "ring":
        return {"forward": (cp - 1) * kv_values * value, "backward": (cp - 1) * kv_values * value + cp * kv_values * 4}
    exchanged = (cp - 1) / cp * (2 * tokens * model.hidden / layout.tp + kv_values) * value
    return {"forward": exchanged, "backward": exchanged}


def context_parallel_time(
    model: ModelSpec, cluster: ClusterSpec, training: Training, layout: Layout, eff: Efficiency, block_compute: float
) -> float:
    """Exposed seconds of one block's context-parallel traffic (one microbatch): the ring's hops overlap the
    attention of the block at hand (up to the block's compute), all-to-alls do not."""
    if layout.cp == 1:
        return 0.0
    sent = context_parallel_bytes(model, training, layout)
    bandwidth = _bandwidth(layout.tp, layout.cp, cluster) * GB * eff.comm
    seconds = (sent["forward"] + sent["backward"]) / bandwidth
    if layout.options.context_parallel_mode == "ring":
        hops = 3 * layout.cp - 2
        return max(0.0, seconds - block_compute) + hops * eff.latency_s
    return seconds + 8 * eff.latency_s


def data_parallel_bytes(
    numel: float,
    zero_stage: int,
    dp: int,
    shard: int | None = None,
    gathered: float | None = None,
    dtype_bytes: int = 4,
) -> dict[str, float]:
    """Bytes one rank sends per step for data parallelism over ``numel`` parameters (ring algorithms: an all-reduce
    sends 2(w-1)/w of the tensor, a reduce-scatter, all-gather or broadcast (w-1)/w), by group: ``shard`` (the ranks
    ZeRO shards over: all of dp, or the HSDP group), ``replicas`` (across HSDP groups) and ``dp`` (all of dp).

    ``gathered``: parameter elements all-gathered per step (ZeRO-3: blocks twice, in forward and backward, the root
    once; default ``numel``, ZeRO-2's one gather). Stage 0 all-reduces gradients over dp; stage 1 reduces each
    gradient to its owner and broadcasts the update (under HSDP: all-reduce over dp, broadcast in the shard group);
    stages 2-3 reduce-scatter gradients in the shard group, all-reduce the shards across replicas and gather.
    """
    k = shard or dp
    r = dp // k
    sent = {"shard": 0.0, "replicas": 0.0, "dp": 0.0}
    whole = numel * dtype_bytes
    if dp <= 1:
        return sent
    if zero_stage == 0:
        sent["dp"] = 2 * (dp - 1) / dp * whole
    elif zero_stage == 1 and r == 1:
        sent["dp"] = 2 * (dp - 1) / dp * whole  # reduce to owners + broadcast: reduce-scatter + all-gather volume
    elif zero_stage == 1:
        sent["dp"] = 2 * (dp - 1) / dp * whole
        sent["shard"] = (k - 1) / k * whole
    else:
        gathered_bytes = (numel if gathered is None else gathered) * dtype_bytes
        sent["shard"] = (k - 1) / k * (whole + gathered_bytes)
        sent["replicas"] = 2 * (r - 1) / r * whole / k
    return sent


def paper_flops_per_step(model: ModelSpec, global_batch: int, checkpointing: str = "full") -> float:
    """FLOPs per step as Narayanan et al. (2021) count them: 3 passes (4 with full recomputation) of every block
    and 3 of the head. For their GPT shapes this is ``96 B s l h^2 (1 + s/6h + V/16lh)`` with recomputation."""
    block, head = model.forward_flops_per_token()
    passes = 4 if checkpointing == "full" else 3
    return global_batch * model.seq_len * (passes * block * model.layers + 3 * head)


def estimate(model: ModelSpec, cluster: ClusterSpec, training: Training, layout: Layout, eff: Efficiency) -> Estimate:
    mem = memory(model, cluster, training, layout)
    times = step_time(model, cluster, training, layout, eff)
    step = times["step"]
    tokens = training.global_batch * model.seq_len
    run_flops = paper_flops_per_step(model, training.global_batch, layout.recomputation)
    model_flops = paper_flops_per_step(model, training.global_batch, "none")
    problems = []
    if mem["total"] > cluster.usable_bytes:
        kinds = ", ".join(f"{k} {v / GB:.1f}" for k, v in mem.items() if k != "total")
        problems.append(
            f"needs {mem['total'] / GB:.1f} GB per GPU, {cluster.usable_bytes / GB:.1f} GB usable of"
            f" {cluster.memory_gb:.4g} ({kinds})"
        )
    return Estimate(
        layout=layout,
        memory=mem,
        time=times,
        tokens_per_s=tokens / step,
        tflops_per_gpu=run_flops / step / layout.world_size / 1e12,
        mfu=model_flops / step / layout.world_size / cluster.peak_flops(training.precision),
        bubble=bubble_fraction(layout),
        fits=not problems,
        problems=problems,
    )
