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


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # words only


def add_word_tokenizer(model: Path, vocab_size: int = 2048) -> Path:
    """Give the tiny model a tokenizer (for `vllm serve`: text prompts, chat): word ``i`` is
    ``w<i>``, words split on whitespace, ids 0-2 are ``<pad>``, ``<s>`` and ``</s>``, 3 is
    ``<unk>``; the chat template joins the messages' words. Returns ``model``."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if (model / "tokenizer.json").exists():
        return model
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials)}
    vocab |= {f"w{i}": i for i in range(len(specials), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.add_special_tokens(specials)
    tok.save(str(model / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model
