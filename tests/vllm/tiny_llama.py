"""A tiny random Llama made locally (no hub): config.json and safetensors weights, no tokenizer.

vLLM's CPU attention needs head size 64 and block sizes that are multiples of 32. Weights are drawn
with a larger spread than usual so that greedy decoding does not collapse onto one token.
"""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(
    out: Path,
    *,
    layers: int = 2,
    sliding_window: int = 0,
    seed: int = 1234,
    max_positions: int = 512,
) -> Path:
    """Write the model to ``out`` (once) and return it. ``sliding_window`` > 0 makes every odd
    layer a sliding-window layer (a hybrid model: two KV-cache groups in vLLM);
    ``max_positions``: the longest sequence it takes (vLLM's largest ``max_model_len``)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if sliding_window:
        cfg.layer_types = [
            "sliding_attention" if i % 2 else "full_attention" for i in range(layers)
        ]
        cfg.sliding_window = sliding_window
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.config.dtype = "float32"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out
