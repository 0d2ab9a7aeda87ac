#!/usr/bin/env python3
"""Real-config-shaped Hugging Face MoE checkpoints for bench/e2e: each shape
is its model's published config.json (the Hub's, as published) with fewer
layers (8 by default) and a vocabulary of 32000, random bf16 weights in the
Hub's tensor names and layout, sharded (one file per layer plus one for the
embeddings and the head, and model.safetensors.index.json), and a byte-level
BPE tokenizer trained here with the `tokenizers` package.

    build(shape_name, out_dir) -> out_dir      # SHAPES names the shapes
    python bench/e2e/checkpoints.py SHAPE OUT_DIR [--layers N]

The weights: every bf16 value has a random sign and mantissa and a magnitude
in [2^-9, 2^-5) (a standard deviation of about 0.014, close to the usual
initializer_range 0.02), drawn from numpy's SFC64 generator seeded by the
shape and the tensor; norms are ones. Writing needs a few MB of memory
whatever the checkpoint's size.

The tokenizer (tokenizer.json, tokenizer_config.json) is Qwen2's pipeline:
NFC, a split by Qwen2's pre-tokenizer regex (TOKENIZER_PRE_REGEX), byte-level
BPE, trained on a synthetic corpus made from a seeded random lexicon, with
the special tokens <|endoftext|> (bos, eos and pad) and <|im_start|>,
<|im_end|>. llama.cpp's convert_hf_to_gguf.py recognises a BPE pre-tokenizer
by the token ids it produces for one fixed text, which no freshly trained
vocabulary matches: TOKENIZER_PRE ("qwen2") is the name of the
pre-tokenizer whose regex this one uses, for a converter that is told it.
"""

import argparse
import copy
import hashlib
import json
import os
import random
import struct
import sys
import time

import numpy as np

VOCAB = 32000
LAYERS = 8
TOKENIZER_PRE = "qwen2"
# Qwen2's pre-tokenizer split (tokenizer.json of the Qwen2/Qwen3 models).
TOKENIZER_PRE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                       r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The published config.json of each model (huggingface.co/<repo>/blob/main/config.json),
# as published; build() sets the layers, the vocabulary and the special token ids.
_QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
_GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                       "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"],
                            "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 201088,
}
_MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}
_DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                 "AutoModel": "modeling_deepseek.DeepseekV2Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 102400,
}

# name -> (Hub repository, published config)
SHAPES = {
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", _QWEN3_30B_A3B),
    "gpt-oss-20b": ("openai/gpt-oss-20b", _GPT_OSS_20B),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", _MIXTRAL_8X7B),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", _DEEPSEEK_V2_LITE),
}


def shape_config(shape_name, layers=LAYERS, vocab=VOCAB, overrides=None):
    """The config.json build() writes for a shape: the published one with
    `layers` layers, a `vocab`-token vocabulary and the special tokens'
    ids, then `overrides` (smaller shapes for tests); GPT-OSS without its
    MXFP4 quantization_config (the weights are bf16), DeepSeek without its
    remote-code auto_map (transformers has the model)."""
    if shape_name not in SHAPES:
        raise ValueError("unknown shape %r; the shapes are %s" % (shape_name, ", ".join(SHAPES)))
    cfg = copy.deepcopy(SHAPES[shape_name][1])
    if layers < 1:
        raise ValueError("a checkpoint needs at least one layer")
    cfg["num_hidden_layers"] = layers
    cfg["vocab_size"] = vocab
    cfg["torch_dtype"] = "bfloat16"
    for key in ("quantization_config", "auto_map"):
        cfg.pop(key, None)
    if "layer_types" in cfg:
        cfg["layer_types"] = [cfg["layer_types"][i % len(cfg["layer_types"])] for i in range(layers)]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = layers
    cfg.update(copy.deepcopy(overrides or {}))
    # Special tokens first in the vocabulary: <|endoftext|> is 0.
    cfg["bos_token_id"] = cfg["eos_token_id"] = cfg["pad_token_id"] = 0
    return cfg


# ---- the tensors of a checkpoint, in the Hub's names and layout ----

def _attention(cfg, p):
    H = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    mt = cfg["model_type"]
    if mt == "deepseek_v2":
        nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        r = cfg["kv_lora_rank"]
        t = []
        if cfg.get("q_lora_rank"):
            q = cfg["q_lora_rank"]
            t += [(p + "q_a_proj.weight", [q, H], "w"), (p + "q_a_layernorm.weight", [q], "one"),
                  (p + "q_b_proj.weight", [nh * (nope + rope), q], "w")]
        else:
            t.append((p + "q_proj.weight", [nh * (nope + rope), H], "w"))
        return t + [(p + "kv_a_proj_with_mqa.weight", [r + rope, H], "w"),
                    (p + "kv_a_layernorm.weight", [r], "one"),
                    (p + "kv_b_proj.weight", [nh * (nope + vd), r], "w"),
                    (p + "o_proj.weight", [H, nh * vd], "w")]
    hd = cfg.get("head_dim") or H // nh
    t = [(p + "q_proj.weight", [nh * hd, H], "w"), (p + "k_proj.weight", [nkv * hd, H], "w"),
         (p + "v_proj.weight", [nkv * hd, H], "w"), (p + "o_proj.weight", [H, nh * hd], "w")]
    if cfg.get("attention_bias"):
        t += [(p + "q_proj.bias", [nh * hd], "w"), (p + "k_proj.bias", [nkv * hd], "w"),
              (p + "v_proj.bias", [nkv * hd], "w"), (p + "o_proj.bias", [H], "w")]
    if mt == "qwen3_moe":
        t += [(p + "q_norm.weight", [hd], "one"), (p + "k_norm.weight", [hd], "one")]
    if mt == "gpt_oss":
        t.append((p + "sinks", [nh], "w"))
    return t


def _glu(p, H, inter, kind):
    return [(p + "gate_proj.weight", [inter, H], kind), (p + "up_proj.weight", [inter, H], kind),
            (p + "down_proj.weight", [H, inter], kind)]


def _mlp(cfg, layer, p):
    H = cfg["hidden_size"]
    mt = cfg["model_type"]
    if mt == "mixtral":
        E, inter = cfg["num_local_experts"], cfg["intermediate_size"]
        q = p + "block_sparse_moe."
        t = [(q + "gate.weight", [E, H], "w")]
        for e in range(E):
            t += [(q + "experts.%d.w1.weight" % e, [inter, H], "expert"),
                  (q + "experts.%d.w2.weight" % e, [H, inter], "expert"),
                  (q + "experts.%d.w3.weight" % e, [inter, H], "expert")]
        return t
    q = p + "mlp."
    if mt == "gpt_oss":
        E, inter = cfg["num_local_experts"], cfg["intermediate_size"]
        return [(q + "router.weight", [E, H], "w"), (q + "router.bias", [E], "w"),
                (q + "experts.gate_up_proj", [E, H, 2 * inter], "expert"),
                (q + "experts.gate_up_proj_bias", [E, 2 * inter], "expert"),
                (q + "experts.down_proj", [E, inter, H], "expert"),
                (q + "experts.down_proj_bias", [E, H], "expert")]
    if mt == "deepseek_v2":
        if layer < cfg["first_k_dense_replace"] or layer % cfg.get("moe_layer_freq", 1):
            return _glu(q, H, cfg["intermediate_size"], "w")
        E, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        t = [(q + "gate.weight", [E, H], "w")]
        for e in range(E):
            t += _glu(q + "experts.%d." % e, H, inter, "expert")
        if cfg.get("n_shared_experts"):
            t += _glu(q + "shared_experts.", H, inter * cfg["n_shared_experts"], "w")
        return t
    if mt == "qwen3_moe":
        step = cfg.get("decoder_sparse_step", 1)
        if layer in cfg.get("mlp_only_layers", []) or (layer + 1) % step:
            return _glu(q, H, cfg["intermediate_size"], "w")
        E, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
        t = [(q + "gate.weight", [E, H], "w")]
        for e in range(E):
            t += _glu(q + "experts.%d." % e, H, inter, "expert")
        return t
    raise ValueError("no tensor layout for model_type %r" % mt)


def tensors(cfg):
    """[(shard, [(name, shape, kind)])]: kind "expert" (a routed expert's
    weight or bias), "w" (any other random weight) or "one" (a norm)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    shards = [("embed", [("model.embed_tokens.weight", [V, H], "w")])]
    for layer in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % layer
        t = [(p + "input_layernorm.weight", [H], "one"),
             (p + "post_attention_layernorm.weight", [H], "one")]
        t += _attention(cfg, p + "self_attn.")
        t += _mlp(cfg, layer, p)
        shards.append(("layer%d" % layer, t))
    head = [("model.norm.weight", [H], "one")]
    if not cfg.get("tie_word_embeddings"):
        head.append(("lm_head.weight", [V, H], "w"))
    shards.append(("head", head))
    return shards


def sizes(cfg):
    """(expert bytes, every other byte) of the checkpoint, bf16."""
    ex = other = 0
    for _, ts in tensors(cfg):
        for _, shape, kind in ts:
            n = 2 * int(np.prod(shape))
            if kind == "expert":
                ex += n
            else:
                other += n
    return ex, other


# ---- writing ----

_CHUNK = 8 << 20  # bf16 values per write


def _random_bf16(gen, n):
    """n random bf16 bit patterns: random sign and mantissa, exponent
    2^-6..2^-9 (values of magnitude [2^-9, 2^-5))."""
    r = gen.random_raw((n + 3) // 4).view(np.uint16)[:n]
    e = (r >> 7) & 3
    np.subtract(121, e, out=e)
    e <<= 7
    r &= 0x807F
    r |= e
    return r


def _write_shard(path, entries, seed):
    header, off = {}, 0
    for name, shape, _ in entries:
        nbytes = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    one = np.full(_CHUNK, 0x3F80, dtype=np.uint16)  # bf16 1.0
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name, shape, kind in entries:
            n = int(np.prod(shape))
            digest = hashlib.sha256(("%d:%s" % (seed, name)).encode()).digest()
            gen = np.random.SFC64(int.from_bytes(digest[:8], "little"))
            while n:
                m = min(n, _CHUNK)
                f.write((one[:m] if kind == "one" else _random_bf16(gen, m)).tobytes())
                n -= m
    os.replace(tmp, path)
    return off


# ---- the tokenizer ----

def _corpus(seed, lines=60000):
    """A deterministic synthetic text: words of a random lexicon with a
    Zipf-like frequency, punctuation, numbers, some code-like lines."""
    rnd = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v",
              "w", "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oo", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x"]
    lexicon = set()
    while len(lexicon) < 60000:
        w = "".join(rnd.choice(onsets) + rnd.choice(vowels) + rnd.choice(codas)
                    for _ in range(rnd.choice((1, 1, 2, 2, 2, 3, 3, 4))))
        lexicon.add(w)
    lexicon = sorted(lexicon)
    rnd.shuffle(lexicon)
    cum, acc = [], 0.0
    for i in range(len(lexicon)):
        acc += 1.0 / (i + 1) ** 0.9
        cum.append(acc)
    punct = [".", ",", ";", ":", "!", "?", " -", " (", ")", "'s", "'ll", "\""]
    for i in range(lines):
        words = rnd.choices(lexicon, cum_weights=cum, k=rnd.randint(4, 24))
        parts = []
        for j, w in enumerate(words):
            if j == 0 or rnd.random() < 0.08:
                w = w.capitalize()
            parts.append(w)
            if rnd.random() < 0.12:
                parts[-1] += rnd.choice(punct)
            if rnd.random() < 0.04:
                parts.append(str(rnd.randint(0, 99999)))
        line = " ".join(parts)
        if i % 17 == 0:
            line = "    %s = %s(%d)" % (words[0], words[-1], rnd.randint(0, 999))
        yield line + "\n"


def write_tokenizer(out_dir, vocab=VOCAB, seed=0):
    """tokenizer.json and tokenizer_config.json: a byte-level BPE of `vocab`
    tokens with Qwen2's normalizer and pre-tokenizer, special tokens first."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TOKENIZER_PRE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=1)
    tok.train_from_iterator(_corpus(seed), trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError("the BPE trainer reached %d tokens, not %d: the corpus is too small"
                           % (tok.get_vocab_size(), vocab))
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    eos = SPECIAL_TOKENS[0]
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos,
          "pad_token": eos, "unk_token": None, "model_max_length": 131072,
          "clean_up_tokenization_spaces": False, "add_bos_token": False,
          "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False,
                                            "rstrip": False, "normalized": False,
                                            "single_word": False}
                                   for i, t in enumerate(SPECIAL_TOKENS)}}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=1)
    return tok.get_vocab_size()


def build_config(cfg, out_dir, seed=0, tokenizer=True, progress=None):
    """Writes the checkpoint of config `cfg` into `out_dir` (created):
    config.json, one bf16 shard per layer plus embeddings and head,
    model.safetensors.index.json and (unless tokenizer=False) the tokenizer.
    Returns out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    shards = tensors(cfg)
    n = len(shards)
    weight_map, total = {}, 0
    for i, (_, entries) in enumerate(shards):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, n)
        t0 = time.monotonic()
        total += _write_shard(os.path.join(out_dir, fname), entries, seed)
        for name, _, _ in entries:
            weight_map[name] = fname
        if progress:
            progress("  shard %d/%d %s (%.1f s)" % (i + 1, n, fname, time.monotonic() - t0))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    if tokenizer:
        write_tokenizer(out_dir, cfg["vocab_size"], seed)
    # config.json last: a directory with one is complete.
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return out_dir


def build(shape_name, out_dir, layers=LAYERS, overrides=None, tokenizer=True, progress=None):
    """The checkpoint of shape `shape_name` (a SHAPES key) in `out_dir`, with
    `layers` layers (8) and a 32000-token vocabulary. Returns out_dir."""
    cfg = shape_config(shape_name, layers, overrides=overrides)
    return build_config(cfg, out_dir, seed=sum(map(ord, shape_name)), tokenizer=tokenizer,
                        progress=progress)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--sizes", action="store_true", help="print the sizes only")
    a = ap.parse_args(argv)
    ex, other = sizes(shape_config(a.shape, a.layers))
    print("%s, %d layers: %.2f GB of experts, %.2f GB of other weights (bf16)"
          % (a.shape, a.layers, ex / 1e9, other / 1e9))
    if not a.sizes:
        t0 = time.monotonic()
        build(a.shape, a.out_dir, a.layers, progress=print)
        print("written in %.0f s" % (time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
