"""Model hyper-parameters read from GGUF metadata, and the model fingerprint."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from shared.errors import GGUFError
from shared.gguf_file import GGUFFile

# Per-architecture facts that llama.cpp hard-codes rather than reading from the file.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_neox": False},
    "gemma3": {"rope_neox": True, "swa_pattern": 6, "rope_base_swa": 10000.0, "embed_scale": True},
    "llada": {"rope_neox": False, "causal": False, "shift_logits": False},
    "dream": {"rope_neox": True, "causal": False, "shift_logits": True},
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_dims: int
    rope_neox: bool
    sliding_window: int = 0           # 0: every layer attends to the whole context
    swa_pattern: int = 0              # every swa_pattern-th layer (1-based) is global
    rope_base_swa: float = 0.0
    embed_scale: bool = False
    causal: bool = True
    # text diffusion (causal False): the token that marks a canvas position still to generate, and
    # whether position i's prediction is row i - 1's logits (Dream) rather than row i's (LLaDA)
    mask_token_id: int = -1
    shift_logits: bool = False
    fingerprint: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def layer_window(self, layer: int) -> int:
        """Sliding window of a layer (0 = global), llama.cpp's pattern: layer il is global when (il + 1) % pattern == 0."""
        if not self.sliding_window or not self.swa_pattern:
            return self.sliding_window
        return 0 if (layer + 1) % self.swa_pattern == 0 else self.sliding_window

    def layer_rope_base(self, layer: int) -> float:
        if self.layer_window(layer) and self.rope_base_swa:
            return self.rope_base_swa
        return self.rope_base

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "ModelConfig":
        md, arch = gguf.metadata, gguf.architecture
        if not arch:
            raise GGUFError(gguf.path, "metadata has no general.architecture")
        defaults = _ARCH_DEFAULTS.get(arch, {})

        def get(key: str, default: Any = None) -> Any:
            value = md.get(f"{arch}.{key}", default)
            if value is None:
                raise GGUFError(gguf.path, f"metadata key {arch}.{key} is missing")
            return value

        d_model = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", d_model // n_heads))
        vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
        if not vocab and "token_embd.weight" in gguf.tensors:
            vocab = gguf.tensors["token_embd.weight"].shape[0]
        causal = bool(defaults.get("causal", True))
        if not causal and "tokenizer.ggml.mask_token_id" not in md:
            raise GGUFError(gguf.path, f"{arch} is a text-diffusion architecture but the file has no "
                                       "tokenizer.ggml.mask_token_id; re-convert it with a current convert_hf_to_gguf.py")
        return cls(
            architecture=arch,
            name=str(md.get("general.name", gguf.path.stem)),
            n_layers=int(get("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            d_ff=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            context_length=int(get("context_length")),
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_base=float(get("rope.freq_base", 10000.0)),
            rope_dims=int(get("rope.dimension_count", head_dim)),
            rope_neox=bool(defaults.get("rope_neox", False)),
            sliding_window=int(get("attention.sliding_window", 0)),
            swa_pattern=int(defaults.get("swa_pattern", 0)),
            rope_base_swa=float(defaults.get("rope_base_swa", 0.0)),
            embed_scale=bool(defaults.get("embed_scale", False)),
            causal=causal,
            mask_token_id=int(md.get("tokenizer.ggml.mask_token_id", -1)),
            # llama.cpp: the file's diffusion.shift_logits, else shifted (its default for Dream)
            shift_logits=bool(md.get("diffusion.shift_logits", defaults.get("shift_logits", False))),
            fingerprint=model_fingerprint(gguf),
        )


def model_fingerprint(gguf: GGUFFile) -> str:
    """Identity of a model for cache keys and KV checkpoints: architecture, every hyper-parameter
    under `<arch>.` (what shapes the K/V: heads, head size, RoPE base and scaling, windows, norm
    epsilons), the tensor directory, and a sample of the tensor bytes."""
    arch = gguf.architecture
    h = hashlib.sha256(arch.encode())
    for key in sorted(k for k in gguf.metadata if k.startswith(f"{arch}.")):
        h.update(f"{key}={gguf.metadata[key]!r};".encode())
    for t in gguf.tensors.values():
        h.update(f"{t.name}:{t.ggml_type}:{t.shape}:{t.nbytes};".encode())
    for t in list(gguf.tensors.values())[:: max(1, len(gguf.tensors) // 16)]:
        raw = gguf.raw(t.name)
        h.update(bytes(raw[:4096]))
        h.update(bytes(raw[-4096:]))
    return h.hexdigest()[:32]
