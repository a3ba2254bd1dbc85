"""Tiny models and a tokenizer for tests: built from configs with a fixed seed, nothing downloaded."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
            "gemma3": Gemma3TextConfig}
# A tiny hybrid: sliding-window layers 0, 1, 3 and 4 around full-attention layers 2 and 5 (Gemma 3 puts one
# full layer after every five sliding ones); a window of 8 tokens matters at the tests' lengths.
HYBRID_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
                      "sliding_attention", "sliding_attention", "full_attention"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
VOCAB_SIZE = 256 + len(SPECIALS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(family: str = "llama", layers: int = 4, heads: int = 4, kv_heads: int = 1, head_dim: int = 16,
                **overrides):
    """A 2–4 layer config of ``family`` with GQA ratio ``heads / kv_heads``."""
    kw = dict(vocab_size=VOCAB_SIZE, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
              max_position_embeddings=4096, bos_token_id=256, eos_token_id=258, pad_token_id=259,
              tie_word_embeddings=False)
    if family == "gemma3":
        kw.update(query_pre_attn_scalar=head_dim, sliding_window=8, layer_types=HYBRID_LAYER_TYPES[:layers])
    kw.update(overrides)
    return FAMILIES[family](**kw)


def tiny_model(family: str = "llama", seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kw), dtype=torch.float32)
    # Random init gives near-uniform attention; sharpen it so sparse and dense paths differ measurably.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # Gemma 3 normalises q and k: scale (1 + w)
                p.fill_(1.0)
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + 4 specials) with a ChatML-like template."""
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_folder(folder, family: str = "llama", **kw):
    """A tiny model of ``family`` and the byte tokenizer saved as a model folder (what ``--model`` takes)."""
    tiny_model(family, **kw).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


SHORT_CONTEXT = 64  # max_position_embeddings of short_context_folder's model


def short_context_folder(folder, **kw):
    """A 2-layer GQA Llama folder whose context is :data:`SHORT_CONTEXT` tokens (``kw``: more config values):
    what the bad-input tests go past."""
    return tiny_folder(folder, "llama", layers=2, heads=4, kv_heads=2, max_position_embeddings=SHORT_CONTEXT, **kw)
