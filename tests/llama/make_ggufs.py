"""Tiny GGUFs for tests/llama, made from the tiny Hugging Face fixtures
(tests/import/fixtures) with llama.cpp's own converter and quantiser.

Runs in the torch environment (convert_hf_to_gguf.py needs torch and
transformers; $QMOE_TORCH_VENV). Per family FAM and type Q (q8_0, q4_0):

    FAM.f32.gguf            convert_hf_to_gguf.py --outtype f32 of the fixture
    FAM.Q.gguf              llama-quantize FAM.f32.gguf Q (gpt_oss also
                            mxfp4_moe: its experts in MXFP4)
    FAM.Q-f32exps.gguf      the same file, except that the routed expert
                            tensors are F32 holding FAM.Q.gguf's dequantised
                            expert weights: llama.cpp then computes the experts
                            in f32 (no activation quantisation) on exactly the
                            weights a bank imported from FAM.Q.gguf holds, and
                            every other tensor is FAM.Q.gguf's, bit for bit.

The fixtures have no tokenizer: each gets a byte-level BPE tokenizer made with
`tokenizers` (31 single characters and <|endoftext|>, the fixtures' vocab_size
of 32, no merges: a text's tokens are its characters) that pre-tokenizes with
Qwen2's regex. Its fingerprint is
not one convert_hf_to_gguf.py knows, so the conversion is told its name
("qwen2", the llama.cpp pre-tokenizer with that regex); without a
tokenizer.model, the sentencepiece path is skipped.

    python make_ggufs.py --share PREFIX/share/qmoed-llama.cpp \
        --quantize PREFIX/bin/llama-quantize --out DIR FAM...

    python make_ggufs.py --share PREFIX/share/qmoed-llama.cpp --convert HF_DIR OUT TYPE

converts one checkpoint that has its own tokenizer (bench/e2e's, whose
pre-tokenizer is Qwen2's) to OUT with --outtype TYPE.
"""
import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "import", "fixtures")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Byte-level symbols: Ġ is the space, Ċ the newline.
VOCAB = ["Ġ"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [".", ",", "Ċ", "!"]
EOS = "<|endoftext|>"
TYPES = ("q8_0", "q4_0")
# Types a family also gets: GPT-OSS's own MXFP4 (llama-quantize MXFP4_MOE:
# the routed experts in MXFP4, what its published GGUFs hold).
EXTRA_TYPES = {"gpt_oss": ("mxfp4_moe",)}


def write_tokenizer(dst):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(VOCAB)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS,
                   "add_bos_token": False, "model_max_length": 64}, f)


def patch_converter(share):
    sys.path.insert(0, share)
    sys.path.insert(1, os.path.join(share, "gguf-py"))
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    sentencepiece = base.TextModel._set_vocab_sentencepiece

    def no_tokenizer_model(self, *args, **kwargs):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError("no tokenizer.model")
        return sentencepiece(self, *args, **kwargs)
    base.TextModel._set_vocab_sentencepiece = no_tokenizer_model
    # llama.cpp refuses a BPE vocabulary without a merges key, and GGUF has no
    # empty arrays: one merge whose result ("qz") is no token, so every text
    # tokenizes as it would without it (llama.cpp falls back to the pieces).
    import gguf
    add_to_gguf = gguf.SpecialVocab.add_to_gguf

    def with_a_merge(self, gw, quiet=False):
        if self.load_merges and not self.merges:
            self.merges = ["q z"]
        return add_to_gguf(self, gw, quiet)
    gguf.SpecialVocab.add_to_gguf = with_a_merge
    # llama.cpp reads deepseek2.attention.q_lora_rank unless the block count is
    # one of DeepSeek-V2-Lite's (26 or 27), and the converter writes it only
    # when the config has one; 0 selects the plain q projection, as None does.
    import conversion.deepseek as deepseek
    ds_params = deepseek.DeepseekV2Model.set_gguf_parameters

    def with_q_lora_rank(self):
        ds_params(self)
        if self.hparams.get("q_lora_rank") is None and self.hparams["num_hidden_layers"] not in (26, 27):
            self.gguf_writer.add_q_lora_rank(0)
    deepseek.DeepseekV2Model.set_gguf_parameters = with_q_lora_rank


def convert(share, hf_dir, out, outtype="f32"):
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype]
    try:
        runpy.run_path(os.path.join(share, "convert_hf_to_gguf.py"), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.argv = argv


def quantize(tool, src, dst, qtype, extra=()):
    r = subprocess.run([tool] + list(extra) + [src, dst, qtype.upper()], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit("llama-quantize %s -> %s failed:\n%s" % (src, dst, (r.stdout + r.stderr)[-3000:]))


def f32_experts_like(tool, f32_gguf, quant_gguf, out, qtype):
    """FAM.Q-f32exps.gguf: quant_gguf's expert weights, dequantised, as F32."""
    import gguf
    tmp = out + ".src.gguf"
    shutil.copyfile(f32_gguf, tmp)
    quant = {t.name: t for t in gguf.GGUFReader(quant_gguf).tensors}
    target = gguf.GGUFReader(tmp, "r+")
    n = 0
    for t in target.tensors:
        if t.name.endswith("_exps.weight"):
            q = quant[t.name]
            t.data[...] = gguf.quants.dequantize(q.data, q.tensor_type).reshape(t.data.shape)
            n += 1
    target.data.flush()
    del target
    if n == 0:
        raise SystemExit("%s has no expert tensors" % f32_gguf)
    quantize(tool, tmp, out, qtype, ["--tensor-type", "_exps=f32"])
    os.remove(tmp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--share", required=True)
    ap.add_argument("--convert", nargs=3, metavar=("HF_DIR", "OUT", "TYPE"))
    ap.add_argument("--quantize")
    ap.add_argument("--out")
    ap.add_argument("families", nargs="*")
    a = ap.parse_args()
    patch_converter(a.share)
    if a.convert:
        convert(a.share, *a.convert)
        return
    if not (a.quantize and a.out and a.families):
        ap.error("--quantize, --out and at least one family are required")
    os.makedirs(a.out, exist_ok=True)
    for fam in a.families:
        hf = os.path.join(a.out, "hf", fam)
        shutil.copytree(os.path.join(FIXTURES, fam), hf, dirs_exist_ok=True)
        for junk in ("golden.safetensors",):
            if os.path.exists(os.path.join(hf, junk)):
                os.remove(os.path.join(hf, junk))
        write_tokenizer(hf)
        f32 = os.path.join(a.out, fam + ".f32.gguf")
        convert(a.share, hf, f32)
        for q in TYPES + EXTRA_TYPES.get(fam, ()):
            qg = os.path.join(a.out, "%s.%s.gguf" % (fam, q))
            quantize(a.quantize, f32, qg, q)
            f32_experts_like(a.quantize, f32, qg, os.path.join(a.out, "%s.%s-f32exps.gguf" % (fam, q)), q)
    print(json.dumps({"out": a.out, "families": a.families}))


if __name__ == "__main__":
    main()
