"""Offline synthesis of a servable model and LoRA adapters: no hub, no torch, no network.

* :func:`write_model` writes a Llama-architecture model (``config.json``, random weights as
  ``model.safetensors``) and a word-level tokenizer built locally (``tokenizer.json`` +
  ``tokenizer_config.json``) that vLLM and transformers load with ``HF_HUB_OFFLINE=1``.
  ``weights=False`` writes the config and tokenizer only, for ``--load-format dummy`` (vLLM fills
  the weights itself; how the study got 8B-shaped runs without real weights).
* :func:`write_adapter` writes one LoRA adapter of a chosen rank in PEFT's layout
  (``adapter_config.json`` + ``adapter_model.safetensors`` with
  ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` etc.).

Shapes are those of vLLM's CPU attention backend constraints: ``head_dim`` must be ≥ 32.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from twin.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from twin.errors import BadInputError

#: Special tokens of the synthetic tokenizer; every other id is the word ``w<id>``.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
FIRST_WORD_ID = len(SPECIAL_TOKENS)
#: Module names a LoRA adapter targets, per layer (attention then MLP), with their (in, out) dims.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-architecture model."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value <= 0:
                raise BadInputError(f"model shape: {name} must be a positive integer (got {value!r})")
        if self.vocab_size <= FIRST_WORD_ID:
            raise BadInputError(f"model shape: vocab_size must be > {FIRST_WORD_ID}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise BadInputError("model shape: num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim < 32:
            raise BadInputError("model shape: head_dim must be >= 32 (vLLM's CPU attention backend)")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes in bf16 (K and V of every layer)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2

    def lora_slot_bytes(self, rank: int, dtype_bytes: int = 2) -> int:
        """Bytes vLLM reserves for one ``--max-loras`` slot at ``--max-lora-rank`` ``rank``: A (r x in) and
        B (out x r) of each projection of every layer, of the embedding (vocab -> hidden) and of the LM head
        (hidden -> vocab), in bf16."""
        per_layer = sum(sum(self.module_dims(m)) for m in (*ATTENTION_MODULES, *MLP_MODULES))
        return dtype_bytes * rank * (self.num_hidden_layers * per_layer + 2 * (self.vocab_size + self.hidden_size))

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one linear module of a decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }[module]

    def hf_config(self) -> dict:
        """A transformers ``LlamaConfig`` as JSON."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(self),
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "initializer_range": 0.02,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "torch_dtype": "float32", "use_cache": True,
        }


#: Named shapes: the tiny model the CPU profile uses, and Llama-3.1-8B for dummy-weight GPU runs.
SHAPES = {
    "tiny": ModelShape(),
    "llama-3.1-8b": ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=131072),
}


def model_shape(name_or_config: str | os.PathLike) -> ModelShape:
    """A named shape (``tiny``, ``llama-3.1-8b``) or the shape in a model directory's config.json."""
    if str(name_or_config) in SHAPES:
        return SHAPES[str(name_or_config)]
    path = Path(name_or_config)
    config = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInputError(f"{config}: not a model shape name ({', '.join(SHAPES)}) nor a readable "
                            f"config.json: {exc}") from None
    if not isinstance(raw, dict):
        raise BadInputError(f"{config}: a model config is a JSON object, not {type(raw).__name__}")
    fields = ModelShape.__dataclass_fields__
    kwargs = {k: raw[k] for k in fields if k in raw}
    if "head_dim" not in raw and "hidden_size" in raw and "num_attention_heads" in raw:
        kwargs["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    kwargs.setdefault("num_key_value_heads", raw.get("num_attention_heads", ModelShape.num_key_value_heads))
    return ModelShape(**kwargs)


def model_context(model_dir: str | os.PathLike) -> int | None:
    """The longest sequence a model directory's config.json allows (None: it does not say, or scales RoPE past it)."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    context = raw.get("max_position_embeddings") if isinstance(raw, dict) and not raw.get("rope_scaling") else None
    return context if isinstance(context, int) and context > 0 else None


def _save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save

    write_bytes_atomic(path, save({k: np.ascontiguousarray(v) for k, v in tensors.items()}))


def write_tokenizer(out_dir: str | os.PathLike, vocab_size: int, model_max_length: int) -> None:
    """A word-level tokenizer: ids 0..2 are ``<unk> <s> </s>``, id n ≥ 3 is the word ``w<n>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = Path(out_dir)
    write_text_atomic(out / "tokenizer.json", tokenizer.to_str())
    write_json_atomic(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
    })


def write_model(out_dir: str | os.PathLike, shape: ModelShape = ModelShape(), seed: int = 0,
                weights: bool = True) -> Path:
    """Write a random-weight Llama model (or, with ``weights=False``, its config and tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "config.json", shape.hf_config())
    write_tokenizer(out, shape.vocab_size, shape.max_position_embeddings)
    if not weights:
        return out
    rng = np.random.default_rng(seed)

    def normal(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)

    h = shape.hidden_size
    tensors = {"model.embed_tokens.weight": normal(shape.vocab_size, h), "lm_head.weight": normal(shape.vocab_size, h),
               "model.norm.weight": np.ones(h, np.float32)}
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = np.ones(h, np.float32)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = np.ones(h, np.float32)
        for group, modules in (("self_attn", ATTENTION_MODULES), ("mlp", MLP_MODULES)):
            for module in modules:
                fan_in, fan_out = shape.module_dims(module)
                tensors[f"{prefix}.{group}.{module}.weight"] = normal(fan_out, fan_in)
    _save_safetensors(out / "model.safetensors", tensors)
    return out


def write_adapter(out_dir: str | os.PathLike, shape: ModelShape, rank: int, seed: int = 0,
                  base_model: str = "") -> Path:
    """Write one LoRA adapter of ``rank`` for every linear module of ``shape``'s decoder layers."""
    if not isinstance(rank, int) or rank <= 0:
        raise BadInputError(f"adapter rank must be a positive integer (got {rank!r})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(shape.num_hidden_layers):
        for group, modules in (("self_attn", ATTENTION_MODULES), ("mlp", MLP_MODULES)):
            for module in modules:
                fan_in, fan_out = shape.module_dims(module)
                key = f"base_model.model.model.layers.{layer}.{group}.{module}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in), np.float32) * 0.02)
                tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, rank), np.float32) * 0.02)
    _save_safetensors(out / "adapter_model.safetensors", tensors)
    write_json_atomic(out / "adapter_config.json", {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": [*ATTENTION_MODULES, *MLP_MODULES], "base_model_name_or_path": base_model,
        "fan_in_fan_out": False, "modules_to_save": None,
    })
    return out


def write_adapters(out_dir: str | os.PathLike, shape: ModelShape, ranks: dict[str, int], base_model: str = "",
                   seed: int = 0) -> dict[str, Path]:
    """One adapter directory per ``name: rank`` under ``out_dir``; returns name → path."""
    return {name: write_adapter(Path(out_dir) / name, shape, rank, seed + i, base_model)
            for i, (name, rank) in enumerate(ranks.items())}


def read_adapter_rank(adapter_dir: str | os.PathLike) -> int:
    """The rank ``r`` in an adapter directory's adapter_config.json (a user's own adapter)."""
    config = Path(adapter_dir) / "adapter_config.json"
    try:
        rank = json.loads(config.read_text(encoding="utf-8"))["r"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInputError(f"{config}: cannot read the LoRA rank 'r': {exc}") from None
    if not isinstance(rank, int) or rank <= 0:
        raise BadInputError(f"{config}: 'r' must be a positive integer (got {rank!r})")
    return rank
