#!/usr/bin/env python3
"""Runs llama.cpp's convert_hf_to_gguf.py (unmodified; $LLAMA_CPP_DIR, default /tmp/lp/llama.cpp, at 0a50d99)
with one in-process workaround: the tiny test tokenizer's pre-tokenizer hash
(chkhsh) is not in get_vocab_base_pre()'s table (it never can be: the hash is
over token ids, which depend on the 512-entry vocab), so the original raises
NotImplementedError.  In that case only, and only if tokenizer.json's
normalizer/pre-tokenizer is byte-for-byte the Qwen2 one, return "qwen2" --
the value llama.cpp maps to LLAMA_VOCAB_PRE_TYPE_QWEN2, whose comment in
src/llama-vocab.cpp quotes exactly this regex as the "original regex from
tokenizer.json".  (The "qwen35" pre-tokenizer uses a different regex with
[\\p{L}\\p{M}], which this tokenizer does not have.)
Usage: same arguments as convert_hf_to_gguf.py.
"""
import json
import logging
import sys
from pathlib import Path

import os  # noqa: E402

LP = os.environ.get("LLAMA_CPP_DIR", "/tmp/lp/llama.cpp")
sys.path.insert(0, LP)

# Environment workaround (Debian 12 python3-torch is 1.13, which predates the
# float8 dtypes). conversion/base.py only uses torch.float8_e4m3fn/_e5m2 as
# dict keys (LazyTorchTensor dtype tables) and in an `in (...)` test on the FP8
# dequant path; no tensor in these checkpoints is FP8, so inert placeholders
# are enough.
import torch  # noqa: E402


class _MissingTorchDtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<missing torch dtype {self.name}>"


for _n in ("float8_e4m3fn", "float8_e5m2"):
    if not hasattr(torch, _n):
        setattr(torch, _n, _MissingTorchDtype(_n))

import conversion.base as base  # noqa: E402

QWEN2_SPLIT_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ],
}

_orig_get_vocab_base_pre = base.TextModel.get_vocab_base_pre
log = logging.getLogger("convert_wrapper")


def _get_vocab_base_pre(self, tokenizer):
    try:
        return _orig_get_vocab_base_pre(self, tokenizer)
    except NotImplementedError:
        with open(Path(self.dir_model) / "tokenizer.json", encoding="utf-8") as f:
            tj = json.load(f)
        if tj.get("pre_tokenizer") == QWEN2_PRE_TOKENIZER and tj.get("normalizer") == {"type": "NFC"} \
                and tj.get("model", {}).get("type") == "BPE":
            log.warning("convert_wrapper: unknown chkhsh, but tokenizer.json has the exact Qwen2 "
                        "pre-tokenizer -> tokenizer.ggml.pre = 'qwen2'")
            return "qwen2"
        raise


base.TextModel.get_vocab_base_pre = _get_vocab_base_pre

sys.argv = [f"{LP}/convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf  # noqa: E402

convert_hf_to_gguf.main()
