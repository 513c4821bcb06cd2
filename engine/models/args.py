"""Model hyper-parameters, read from a checkpoint's metadata by the loader."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(slots=True)
class LongRope:
    """Phi-3's LongRoPE (rope_type "longrope"): each rotary pair's base frequency divided by its factor, the short
    factors for a context of at most original_max_position_embeddings tokens, the long ones beyond (models/rope.py
    decides which), and cos and sin multiplied by attention_factor."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(slots=True)
class SlidingWindow:
    """Gemma 3's local layers: attention over the last `size` tokens only, with their own RoPE base."""

    size: int
    layers: tuple[bool, ...]  # per layer: True = sliding-window (local), False = global
    rope_theta: float  # the local layers' RoPE base (rope_local_base_freq)


@dataclass(slots=True)
class ModelArgs:
    arch: str  # "llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma3"
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int  # intermediate size of the SwiGLU MLP (of each expert in a mixture-of-experts model)
    vocab_size: int
    max_seq_len: int  # context length
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False  # lm_head shares token embeddings
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and k before RoPE
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    rope_linear_factor: float = 1.0  # positions divided by it ("linear" RoPE scaling; Gemma 3: global layers only)
    sliding_window: SlidingWindow | None = None  # Gemma 3
    rotary_dim: int | None = None  # dims of each head RoPE rotates, the first ones (Phi-4-mini: 3/4); None: head_dim
    long_rope: LongRope | None = None  # Phi-3 128k, Phi-4-mini
    # mixture of experts (Mixtral, Qwen3-MoE; models/moe.py): every layer's MLP is n_experts SwiGLU experts, of which
    # each token runs n_experts_used, weighted by the softmax of the router's logits over all experts taken at the
    # top n_experts_used, renormalised to sum 1 when norm_topk_prob (Mixtral always: the softmax of the top logits)
    n_experts: int = 0  # 0: a dense model
    n_experts_used: int = 0
    norm_topk_prob: bool = True
    n_local_experts: int = 0  # a replica group rank's run of the experts (distributed/sharding.py); 0: all n_experts

    @property
    def experts_held(self) -> int:
        """The experts this process builds of each layer."""
        return self.n_local_experts or self.n_experts

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.sliding_window is not None and len(self.sliding_window.layers) != self.n_layers:
            raise ValueError(f"sliding_window.layers has {len(self.sliding_window.layers)} entries for "
                             f"{self.n_layers} layers")
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise ValueError(f"n_experts_used={self.n_experts_used}: must be in [1, n_experts={self.n_experts}]")
        self.rotary_dim = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim}: must be even and in (0, head_dim={self.head_dim}]")
        r = self.long_rope
        if r is not None and not len(r.short_factor) == len(r.long_factor) == self.rotary_dim // 2:
            raise ValueError(f"LongRoPE short_factor / long_factor have {len(r.short_factor)} / {len(r.long_factor)} "
                             f"values; rotary_dim={self.rotary_dim} needs {self.rotary_dim // 2} each")
