"""Model shapes the measuring tools know: built-in configs and a small GPT-style model.

- :class:`ModelConfig`: the hyperparameters that decide memory (vocabulary,
  width, depth, heads, KV heads, MLP width and kind, norm kind, tied
  embeddings).
- :data:`BUILTIN_CONFIGS`: ``gpt2``, ``gpt2-medium``, ``llama-2-7b``,
  ``llama-3-8b``, ``qwen2-72b`` with their published hyperparameters, and
  ``tiny-gpt`` and ``tiny-llama``, the embedded models of ``memkernels report``.
- :func:`load_config`: a built-in name, a Hugging Face config object, a dict
  or the path of a ``config.json`` (read as plain JSON: no network, no
  ``transformers`` import).
- :class:`TransformerLM`: one decoder-only language model that covers both
  families: GPT-2 style (LayerNorm, GELU MLP with biases, learned positions)
  and Llama style (RMSNorm, SwiGLU MLP, rotary positions, grouped-query
  attention). Build it on ``torch.device("meta")`` to measure a 70B model for
  free; :mod:`memkernels.planning.estimate` does exactly that.
"""
import dataclasses
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ModelConfig", "BUILTIN_CONFIGS", "load_config", "TransformerLM", "synthetic_batch"]

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "gelu_tanh", "swiglu", "geglu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer LM (everything memory depends on).

    ``mlp``: ``gelu``/``gelu_tanh`` (fc → GELU → proj, GPT-2 style),
    ``swiglu`` (Llama: down(silu(gate(x)) * up(x))) or ``geglu`` (Gemma: GELU
    gate). ``position``: ``learned`` (absolute embeddings, GPT-2) or ``rope``.
    ``bias``: biases on every linear (GPT-2); ``qkv_bias``: on q/k/v only (Qwen2).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_seq_len: int
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: str = "swiglu"
    position: str = "rope"
    tie_embeddings: bool = False
    bias: bool = False
    qkv_bias: bool = False
    head_dim: int = None
    rope_theta: float = 10000.0
    embedding_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden_size)

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "intermediate_size", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig({self.name!r}): {field}={value!r} must be a positive int")
        if self.norm not in NORMS:
            raise ValueError(f"ModelConfig({self.name!r}): norm={self.norm!r}; use one of {NORMS}")
        if self.mlp not in MLPS:
            raise ValueError(f"ModelConfig({self.name!r}): mlp={self.mlp!r}; use one of {MLPS}")
        if self.position not in ("learned", "rope"):
            raise ValueError(f"ModelConfig({self.name!r}): position={self.position!r}; use 'learned' or 'rope'")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig({self.name!r}): num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"ModelConfig({self.name!r}): hidden_size={self.hidden_size} is not divisible by "
                                 f"num_heads={self.num_heads}; pass head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    def replace(self, **changes):
        """A copy with some fields changed (e.g. ``num_layers=1``)."""
        return dataclasses.replace(self, **changes)

    def num_parameters(self):
        """Exact parameter count of :class:`TransformerLM` built from this config."""
        with torch.device("meta"):
            model = TransformerLM(self)
        return sum(p.numel() for p in model.parameters())


def _gpt2(name, hidden, layers, heads):
    return ModelConfig(name=name, vocab_size=50257, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=heads, intermediate_size=4 * hidden, max_seq_len=1024, norm="layernorm",
                       norm_eps=1e-5, mlp="gelu_tanh", position="learned", tie_embeddings=True, bias=True)


# Published hyperparameters (the models' Hugging Face config.json files).
BUILTIN_CONFIGS = {
    "gpt2": _gpt2("gpt2", 768, 12, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 1024, 24, 16),
    "llama-2-7b": ModelConfig(name="llama-2-7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                              num_kv_heads=32, intermediate_size=11008, max_seq_len=4096, norm_eps=1e-5),
    "llama-3-8b": ModelConfig(name="llama-3-8b", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                              num_kv_heads=8, intermediate_size=14336, max_seq_len=8192, norm_eps=1e-5,
                              rope_theta=500000.0),
    "qwen2-72b": ModelConfig(name="qwen2-72b", vocab_size=152064, hidden_size=8192, num_layers=80, num_heads=64,
                             num_kv_heads=8, intermediate_size=29568, max_seq_len=32768, norm_eps=1e-6,
                             qkv_bias=True, rope_theta=1000000.0),
    # The embedded default of `memkernels report`: GPT-2 shaped, small enough that one
    # CPU training step takes about a second.
    "tiny-gpt": ModelConfig(name="tiny-gpt", vocab_size=16384, hidden_size=384, num_layers=6, num_heads=6,
                            num_kv_heads=6, intermediate_size=1536, max_seq_len=1024, norm="layernorm",
                            mlp="gelu_tanh", position="learned", tie_embeddings=True, bias=True),
    # Its Llama-style companion in `memkernels report`: RMSNorm, SwiGLU, grouped-query attention,
    # rotary positions, an untied head; about as costly per step.
    "tiny-llama": ModelConfig(name="tiny-llama", vocab_size=16384, hidden_size=384, num_layers=6, num_heads=6,
                              num_kv_heads=2, intermediate_size=1024, max_seq_len=1024, norm="rmsnorm",
                              mlp="swiglu", position="rope", tie_embeddings=False),
}

# Hugging Face model types load_config translates into a ModelConfig (memkernels' own TransformerLM). Others that
# transformers knows (mixture-of-experts families among them) are built by transformers itself where a tool needs
# the model: estimate and plan (memkernels.planning.estimate.ModelSource).
TRANSLATED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "gemma")


_GELU_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def _from_hf_dict(cfg, name):
    """Translate a Hugging Face config dict (GPT-2, Llama, Mistral, Qwen2, Gemma families)."""
    model_type = cfg.get("model_type")
    if model_type == "gpt2":
        hidden = cfg.get("n_embd", 768)
        act = cfg.get("activation_function", "gelu_new")
        return ModelConfig(
            name=name, vocab_size=cfg.get("vocab_size", 50257), hidden_size=hidden,
            num_layers=cfg.get("n_layer", 12), num_heads=cfg.get("n_head", 12), num_kv_heads=cfg.get("n_head", 12),
            intermediate_size=cfg.get("n_inner") or 4 * hidden, max_seq_len=cfg.get("n_positions", 1024),
            norm="layernorm", norm_eps=cfg.get("layer_norm_epsilon", 1e-5), mlp=_GELU_ACTS.get(act, "gelu_tanh"),
            position="learned", tie_embeddings=cfg.get("tie_word_embeddings", True), bias=True)
    if model_type in ("llama", "mistral", "qwen2", "gemma"):
        missing = [key for key in ("num_attention_heads", "vocab_size", "hidden_size", "num_hidden_layers",
                                   "intermediate_size") if key not in cfg]
        if missing:
            raise ValueError(f"model config: the {model_type} config {name!r} lacks {', '.join(missing)}; a "
                             "Hugging Face config.json of this family has them")
        heads = cfg["num_attention_heads"]
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        gemma = model_type == "gemma"
        return ModelConfig(
            name=name, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, intermediate_size=cfg["intermediate_size"],
            max_seq_len=cfg.get("max_position_embeddings", 4096), norm="rmsnorm",
            norm_eps=cfg.get("rms_norm_eps", 1e-6), mlp="geglu" if act in _GELU_ACTS else "swiglu",
            position="rope", tie_embeddings=cfg.get("tie_word_embeddings", gemma),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            head_dim=cfg.get("head_dim"), rope_theta=cfg.get("rope_theta", 10000.0), embedding_scale=gemma)
    raise ValueError(f"model config: Hugging Face model_type={model_type!r} is not supported; supported: "
                     f"{', '.join(TRANSLATED_MODEL_TYPES)} (or pass a built-in name: "
                     f"{', '.join(BUILTIN_CONFIGS)})")


def _file_kind(error):
    if isinstance(error, UnicodeDecodeError):
        return f"a binary file (byte {error.object[error.start]:#04x} at offset {error.start} is not UTF-8 text)"
    return f"text that is not valid JSON ({error})"


def hf_config_dict(spec):
    """``(config dict, name, path read or None)`` of a Hugging Face config given as a dict, a ``PretrainedConfig``, a
    config.json path or the model directory holding one; None for a built-in name or a :class:`ModelConfig`. A
    path that does not hold a config.json's JSON object raises ValueError naming it."""
    if isinstance(spec, ModelConfig):
        return None
    if isinstance(spec, str):
        if spec.lower() in BUILTIN_CONFIGS:  # names as people type them: Llama-3-8B, GPT2
            return None
        if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json")):
            spec = os.path.join(spec, "config.json")  # a Hugging Face model directory
        if spec.endswith(".json") or os.path.sep in spec:
            if not os.path.isfile(spec):
                raise ValueError(f"model {spec!r}: no such file; pass a config.json path or a built-in "
                                 f"name ({', '.join(BUILTIN_CONFIGS)})")
            with open(spec, "rb") as handle:
                try:
                    data = json.loads(handle.read().decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as error:
                    raise ValueError(f"model {spec!r}: not a Hugging Face config.json (a JSON object "
                                     f"of the model's hyperparameters) but {_file_kind(error)}") from None
            if not isinstance(data, dict):
                raise ValueError(f"model {spec!r}: holds a JSON {type(data).__name__}; a Hugging Face "
                                 "config.json is a JSON object of the model's hyperparameters")
            return data, os.path.basename(os.path.dirname(os.path.abspath(spec))) or spec, spec
        raise ValueError(f"unknown model {spec!r}; use a built-in name ({', '.join(BUILTIN_CONFIGS)}) "
                         "or the path of a Hugging Face config.json")
    if isinstance(spec, dict):
        return dict(spec), spec.get("_name_or_path") or spec.get("model_type", "hf-config"), None
    if hasattr(spec, "to_dict") and hasattr(spec, "model_type"):  # a transformers PretrainedConfig
        data = spec.to_dict()
        data.setdefault("model_type", spec.model_type)
        return data, data.get("_name_or_path") or spec.model_type, None
    raise ValueError(f"model: cannot read a model config from {type(spec).__name__}; pass a built-in name, "
                     "a ModelConfig, a Hugging Face config (object or dict) or a config.json path")


def load_config(spec):
    """A :class:`ModelConfig` from a built-in name, a HF config (object or dict) or a config.json path."""
    if isinstance(spec, ModelConfig):
        return spec
    hf = hf_config_dict(spec)
    return BUILTIN_CONFIGS[spec.lower()] if hf is None else translate_hf_config(*hf)


def translate_hf_config(data, name, read_from=None):
    """A :class:`ModelConfig` from :func:`hf_config_dict`'s ``(config dict, name, path read or None)``, for the
    :data:`TRANSLATED_MODEL_TYPES`; ValueError naming the path for any other."""
    try:
        return _from_hf_dict(data, name)
    except ValueError as error:
        if read_from is None:
            raise
        raise ValueError(f"{error} (read from {read_from!r})") from None


def _norm(config):
    if config.norm == "layernorm":
        return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=True)
    return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads; flash-style SDPA (saves q, k, v, out, lse). Positions come
    from elsewhere (GPT-2's learned embeddings): ``forward(x)``; :class:`RotaryAttention` rotates q and k."""

    def __init__(self, config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        qkv_bias = config.bias or config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.bias)

    def project(self, x):
        """q (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim)."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def attend(self, q, k, v):
        batch, _, seq, _ = q.shape
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def forward(self, x, rope=None):
        return self.attend(*self.project(x))


class RotaryAttention(Attention):
    """:class:`Attention` with rotary positions: q and k rotated by ``rope`` = (cos, sin), each (seq, head_dim),
    through :func:`apply_rotary_pos_emb` (Hugging Face's signature, so ``memkernels.apply`` fuses it as it does
    Llama's)."""

    def forward(self, x, rope=None):
        q, k, v = self.project(x)
        cos, sin = rope
        q, k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
        return self.attend(q, k, v)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotate-half RoPE: q (batch, heads, seq, d) and k (batch, kv_heads, seq, d) by cos, sin (batch or 1, seq, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MLP(nn.Module):
    """GELU MLP (fc1 → act → fc2), the shape ``FusedMLP.from_modules(fc1, act, fc2)`` takes."""

    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.act = nn.GELU(approximate="tanh" if config.mlp == "gelu_tanh" else "none")
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (Llama, Qwen2) or GeGLU (Gemma)."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)
        self.act = nn.SiLU() if config.mlp == "swiglu" else nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, config):
        super().__init__()
        self.norm1 = _norm(config)
        self.attn = RotaryAttention(config) if config.position == "rope" else Attention(config)
        self.norm2 = _norm(config)
        self.mlp = GatedMLP(config) if config.mlp in ("swiglu", "geglu") else MLP(config)

    def forward(self, x, rope=None):
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class LogitsLoss(nn.Module):
    """LM head + next-token cross-entropy the usual way: full logits, upcast to fp32.

    ``memkernels.apply`` swaps it for the fused linear cross-entropy, which never
    materializes the logits. No parameters of its own: the head weight is passed in.
    """

    def forward(self, hidden, weight, labels, bias=None):
        logits = F.linear(hidden, weight, bias).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


class TransformerLM(nn.Module):
    """Decoder-only LM built from a :class:`ModelConfig` (random init).

    ``forward(input_ids)`` → logits (batch, seq, vocab); ``forward(input_ids,
    labels)`` → scalar mean next-token loss (labels are shifted inside, as in
    Hugging Face: ``labels[:, 1:]`` are the targets of positions ``:-1``).
    ``input_ids``/``labels``: int64 (batch, seq). Set ``model.checkpointing =
    True`` for per-block activation checkpointing.
    """

    def __init__(self, config):
        super().__init__()
        config = load_config(config)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_embed = (nn.Embedding(config.max_seq_len, config.hidden_size)
                          if config.position == "learned" else None)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = _norm(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.loss_fn = LogitsLoss()
        self.checkpointing = False
        if not any(p.is_meta for p in self.parameters()):
            self._init_weights()

    def _init_weights(self):
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def _rope(self, seq, x):
        if self.pos_embed is not None:
            return None
        dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, device=x.device).float() / dim))
        angles = torch.outer(torch.arange(seq, device=x.device).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def hidden_states(self, input_ids):
        """Final-norm hidden states (batch, seq, hidden), before the LM head."""
        batch, seq = _check_ids(input_ids, self.config)
        x = self.embed(input_ids)
        if self.config.embedding_scale:
            x = x * math.sqrt(self.config.hidden_size)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(seq, device=input_ids.device))
        rope = self._rope(seq, x)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, use_reentrant=True)
            else:
                x = block(x, rope)
        return self.norm(x)

    def forward(self, input_ids, labels=None):
        hidden = self.hidden_states(input_ids)
        if labels is None:
            return self.lm_head(hidden)
        if labels.shape != input_ids.shape:
            raise ValueError(f"TransformerLM: labels has shape {tuple(labels.shape)} but input_ids has "
                             f"{tuple(input_ids.shape)}; they must match")
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return self.loss_fn(hidden, self.lm_head.weight, targets)


def _check_ids(input_ids, config):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("TransformerLM: input_ids must be an int64 tensor of shape (batch, seq)")
    batch, seq = input_ids.shape
    if seq > config.max_seq_len and config.position == "learned":
        raise ValueError(f"TransformerLM({config.name}): seq={seq} exceeds max_seq_len={config.max_seq_len} "
                         "of its learned position embeddings")
    return batch, seq


def synthetic_batch(config, batch, seq, device="cpu", generator=None):
    """Random token ids (batch, seq) int64 in [0, vocab): inputs and labels of a synthetic LM step."""
    config = load_config(config)
    if device == "meta" or (isinstance(device, torch.device) and device.type == "meta"):
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    return torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
