"""Tiny random HuggingFace (PyTorch) models, one per supported family, built offline."""

from __future__ import annotations

import numpy as np

VOCAB = 97

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6,
)

# name -> (architecture class name, config class name, config overrides). Together they
# cover GQA and MQA, tied and untied embeddings, qkv bias, qk-norm with a head_dim that
# is not d_model / n_heads, llama3 and linear RoPE scaling, and a sliding window.
CASES = {
    "llama_llama3_rope": ("LlamaForCausalLM", "LlamaConfig", dict(
        rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama_linear_rope_tied": ("LlamaForCausalLM", "LlamaConfig", dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True)),
    "qwen2_bias_tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3_qknorm_mqa": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        head_dim=24, num_key_value_heads=1, tie_word_embeddings=False)),
    "mistral_window": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=4, head_dim=16)),
}


def build_hf_model(case: str, seed: int = 0):
    import torch
    import transformers

    arch, cfg_name, overrides = CASES[case]
    config = getattr(transformers, cfg_name)(**{**COMMON, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: randomise them too
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def padded_batch(seed: int = 0, batch: int = 3, length: int = 11):
    """Left-padded token batch, its padding mask and per-sequence positions."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, VOCAB, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), bool)
    for b in range(1, batch):
        mask[b, : 2 * b + 1] = False
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions


def hf_logits(model, tokens, mask, positions, **kw):
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(positions, dtype=torch.long),
            **kw,
        )
    return out
