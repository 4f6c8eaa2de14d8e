"""Step latency of an 8B-shaped model on a CUDA GPU, measured with PyTorch, beside the profile's terms.

    python -m benchmarks.fidelity.gpu_step_latency [--model llama-3.1-8b|qwen2.5-7b] [--context TOKENS] [--out FILE]

Needs a CUDA GPU and PyTorch; it is not part of the test suite. CUDA vLLM is the engine the twin's
H100 profiles model, but where it cannot be installed (a machine with no package registry, as the
GPU machines this project is lent) this script still measures on the hardware the terms of
``twin.core.step_ms`` that physics sets, so a profile's constants can be checked against a real GPU:

* backbone decode step vs running requests B (``k4``·B + ``k5``): a decoder of the shape of
  Llama-3.1-8B or Qwen2.5-7B (their config.json: layers, hidden size, heads, MLP, vocabulary) with
  random bf16 weights ("dummy" weights, as the study's 8B runs), one token per request over a KV cache
  of ``--context`` tokens, captured as one CUDA graph per shape the way vLLM captures its decode steps;
* prefill cost per prompt token (``kp``): one chunk of T prompt tokens, causal attention;
* LoRA overhead vs distinct adapters in the batch (``k7`` + ``k6``·A, % of the backbone step) at the
  study's profiling batch of 220: LoRA on the fused qkv, o, gate/up and down projections, each
  adapter's rows gathered in one segment and applied by two batched matmuls (shrink, expand), the
  way punica's segmented kernels read each adapter once per step.

It is not vLLM: no paged attention, no Triton punica kernels, no scheduler, a bf16 KV cache of one
fixed context. The figures bound what the engine's kernels can do on this GPU; the study measured
vLLM 0.8.5 on an H100 64GB (HBM2e), this project's GPU machines are H100 80GB (HBM3) or H200.
Writes ``artifacts/benchmarks/gpu_step_latency_<model>_ctx<context>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Shape:
    """A decoder's size, from its config.json, and the profile of the same model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    profile: str

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def lora_modules(self) -> tuple[tuple[int, int], ...]:
        """(input, output) features of the projections LoRA applies to: fused qkv, o, fused gate/up, down."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return (self.hidden, qkv), (self.hidden, self.hidden), (self.hidden, 2 * self.mlp), (self.mlp, self.hidden)


MODELS = {
    "llama-3.1-8b": Shape(32, 4096, 32, 8, 14336, 128256, "h100-64gb-llama-3.1-8b"),
    "qwen2.5-7b": Shape(28, 3584, 28, 4, 18944, 152064, "h100-64gb-qwen2.5-7b"),
}
DECODE_BATCHES = (1, 16, 32, 64, 128, 220, 256, 384, 512, 768)
PREFILL_TOKENS = (256, 512, 1024, 2048)
LORA_BATCH = 220  # the study's LoRA-overhead runs (max_num_seqs 220)
LORA_ADAPTERS = {8: (1, 4, 11, 22, 44, 110, 220), 16: (1, 11, 44), 32: (1, 11, 44)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b",
                    help="model shape; its H100 profile's step terms are shown beside")
    ap.add_argument("--context", type=int, default=128, help="KV-cache tokens per request in decode steps")
    ap.add_argument("--repeats", type=int, default=30, help="timed graph replays per shape")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    shape = MODELS[args.model]
    out = args.out or result_path(f"gpu_step_latency_{args.model}_ctx{args.context}")
    try:
        import torch
    except ImportError:
        sys.exit("gpu_step_latency: PyTorch is not installed (this benchmark needs PyTorch with CUDA)")
    if not torch.cuda.is_available():
        sys.exit("gpu_step_latency: no CUDA GPU visible")
    torch.manual_seed(0)
    bench = Bench(torch, shape, args.context, args.repeats)
    t0 = time.perf_counter()
    decode = [{"batch": b, "ms": bench.decode(b)} for b in DECODE_BATCHES]
    prefill = [{"prompt_tokens": t, "ms": bench.prefill(t)} for t in PREFILL_TOKENS]
    backbone_220 = bench.decode(LORA_BATCH)
    lora = []
    for rank, counts in LORA_ADAPTERS.items():
        bench.load_adapters(rank, max(counts))
        for n in counts:
            ms = bench.decode(LORA_BATCH, n_adapters=n)
            lora.append({"rank": rank, "distinct_adapters": n, "ms": ms, "pct_of_backbone": 100 * ms / backbone_220})
            log(f"LoRA rank {rank}, {n} adapters: {ms:.2f} ms")
        bench.load_adapters(rank, 0)
    k4, k5 = np.polyfit([r["batch"] for r in decode], [r["ms"] for r in decode], 1)
    kp, _ = np.polyfit([r["prompt_tokens"] for r in prefill], [r["ms"] for r in prefill], 1)
    r8 = [r for r in lora if r["rank"] == 8]
    k6, k7 = np.polyfit([r["distinct_adapters"] for r in r8], [r["pct_of_backbone"] for r in r8], 1)
    prof = json.loads((ROOT / "artifacts" / "profiles" / f"{shape.profile}.json").read_text())["step_latency_ms"]
    result = {
        "benchmark": "gpu_step_latency",
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
        "model": args.model, "model_shape": {**asdict(shape), "dtype": "bfloat16", "weights": "random (dummy)"},
        "context_tokens": args.context, "repeats": args.repeats, "wall_s": round(time.perf_counter() - t0, 1),
        "decode": decode, "prefill": prefill, "lora_batch": LORA_BATCH, "backbone_ms_at_lora_batch": backbone_220,
        "lora": lora,
        "fitted": {"k4_ms_per_request": k4, "k5_ms": k5, "kp_ms_per_prompt_token": kp,
                   "k6_pct_per_adapter_rank8": k6, "k7_pct_rank8": k7},
        "profile": {"id": shape.profile, **{k: prof[k] for k in (
            "k4_ms_per_request", "k5_ms", "kp_ms_per_prompt_token", "k6_pct_per_adapter", "k7_pct")}},
        "not_measured": "vLLM itself: PyTorch decoder with CUDA graphs and SDPA attention over a dense bf16 KV "
                        "cache, LoRA by batched matmuls per adapter segment (not punica's Triton kernels)",
    }
    write_result(out, result)
    print(json.dumps(result["fitted"]), json.dumps(result["profile"]))
    print(f"wrote {out}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bench:
    """The decoder's weights on the GPU, and graph-captured steps timed with CUDA events."""

    def __init__(self, torch, shape: Shape, context: int, repeats: int):
        self.torch, self.shape, self.context, self.repeats = torch, shape, context, repeats
        dev, dt = "cuda", torch.bfloat16

        def weight(*shape):
            return torch.randn(*shape, device=dev, dtype=dt) * 0.02

        self.embed = weight(shape.vocab, shape.hidden)
        self.lm_head = weight(shape.hidden, shape.vocab)
        self.layers = [{"ln1": torch.ones(shape.hidden, device=dev, dtype=dt),
                        "ln2": torch.ones(shape.hidden, device=dev, dtype=dt),
                        "w": [weight(i, o) for i, o in shape.lora_modules]} for _ in range(shape.layers)]
        self.adapters: list[list[tuple]] = []  # per layer, per module: (A [n, in, r], B [n, r, out])

    def load_adapters(self, rank: int, n: int) -> None:
        """Give every layer ``n`` adapters of ``rank`` (0: none)."""
        self.adapters = []
        self.torch.cuda.empty_cache()
        if n:
            self.adapters = [[(self.torch.randn(n, i, rank, device="cuda", dtype=self.torch.bfloat16) * 0.02,
                               self.torch.randn(n, rank, o, device="cuda", dtype=self.torch.bfloat16) * 0.02)
                              for i, o in self.shape.lora_modules] for _ in range(self.shape.layers)]

    def _linear(self, x, layer: int, m: int, n_adapters: int):
        y = x @ self.layers[layer]["w"][m]
        if n_adapters:
            a, b = self.adapters[layer][m]
            seg = x.view(n_adapters, -1, x.shape[-1])  # rows sorted by adapter, equal segments
            y = y + self.torch.bmm(self.torch.bmm(seg, a[:n_adapters]), b[:n_adapters]).view(y.shape)
        return y

    @staticmethod
    def _rms(x, w):
        return x * (x.float().pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt().to(x.dtype) * w

    def _forward(self, tokens, caches, n_adapters: int, causal: bool):
        """One engine step: ``tokens`` [B, T] (B decodes with T=1, or one prefill chunk with B=1)."""
        F = self.torch.nn.functional
        s = self.shape
        bsz, t = tokens.shape
        q_end, k_end = s.heads * s.head_dim, (s.heads + s.kv_heads) * s.head_dim
        h = self.embed[tokens].view(bsz * t, s.hidden)
        for li, layer in enumerate(self.layers):
            qkv = self._linear(self._rms(h, layer["ln1"]), li, 0, n_adapters).view(bsz, t, -1)
            q = qkv[..., :q_end].view(bsz, t, s.heads, s.head_dim).transpose(1, 2)
            k = qkv[..., q_end:k_end].view(bsz, t, s.kv_heads, s.head_dim).transpose(1, 2)
            v = qkv[..., k_end:].view(bsz, t, s.kv_heads, s.head_dim).transpose(1, 2)
            kc, vc = caches[li]
            kc[:, :, -t:].copy_(k)
            vc[:, :, -t:].copy_(v)
            att = F.scaled_dot_product_attention(q, kc, vc, is_causal=causal, enable_gqa=True)
            h = h + self._linear(att.transpose(1, 2).reshape(bsz * t, s.hidden), li, 1, n_adapters)
            gu = self._linear(self._rms(h, layer["ln2"]), li, 2, n_adapters)
            h = h + self._linear(F.silu(gu[:, :s.mlp]) * gu[:, s.mlp:], li, 3, n_adapters)
        last = h.view(bsz, t, s.hidden)[:, -1]
        return (last @ self.lm_head).argmax(-1)

    def _timed(self, tokens, context: int, n_adapters: int = 0, causal: bool = False) -> float:
        """Median ms of one graph-captured step."""
        torch = self.torch
        shape = (tokens.shape[0], self.shape.kv_heads, context, self.shape.head_dim)
        caches = [(torch.zeros(shape, device="cuda", dtype=torch.bfloat16),
                   torch.zeros(shape, device="cuda", dtype=torch.bfloat16)) for _ in range(self.shape.layers)]
        with torch.inference_mode():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(tokens, caches, n_adapters, causal)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._forward(tokens, caches, n_adapters, causal)
            for _ in range(3):
                graph.replay()
            times = []
            for _ in range(self.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        del graph, caches
        torch.cuda.empty_cache()
        return float(np.median(times))

    def decode(self, batch: int, n_adapters: int = 0) -> float:
        tokens = self.torch.randint(0, self.shape.vocab, (batch, 1), device="cuda")
        ms = self._timed(tokens, self.context, n_adapters)
        if not n_adapters:
            log(f"decode batch {batch}: {ms:.2f} ms")
        return ms

    def prefill(self, prompt_tokens: int) -> float:
        tokens = self.torch.randint(0, self.shape.vocab, (1, prompt_tokens), device="cuda")
        ms = self._timed(tokens, prompt_tokens, causal=True)
        log(f"prefill {prompt_tokens} tokens: {ms:.2f} ms")
        return ms


if __name__ == "__main__":
    main()
