"""Minimal stand-in for the parts of HF `transformers` that llama.cpp's
convert_hf_to_gguf.py (commit 0a50d99) touches for Qwen2-style byte-level BPE
checkpoints (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next).  Everything is read straight
from config.json / tokenizer.json / tokenizer_config.json with the json module.

Used by the converter:
  * conversion/base.py:18    `from transformers import AutoConfig` (module level)
      -> ModelBase.load_hparams: AutoConfig.from_pretrained(dir).to_dict()
  * conversion/base.py:1346  `from transformers import AutoTokenizer`
      -> get_vocab_base(): .vocab, .get_added_vocab(), .added_tokens_decoder,
         .encode(text[, add_special_tokens]), .decode(ids)
      -> get_vocab_base_pre(): .encode(chktxt) (hashed)
Not a general implementation: only NFC/none normalizer, Split(regex)+ByteLevel
pre-tokenizer, BPE model without dropout/byte_fallback/unk, ByteLevel decoder.
Anything else raises NotImplementedError rather than guessing.
"""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import regex  # Debian python3-regex; needed for \p{L} / \p{N}

__all__ = ["AutoConfig", "AutoTokenizer", "AddedToken"]
__version__ = "0.0.0-stub"


class _Config:
    def __init__(self, d: dict):
        self._d = d

    def to_dict(self) -> dict:
        return json.loads(json.dumps(self._d))  # deep copy


class AutoConfig:
    @staticmethod
    def from_pretrained(path, trust_remote_code: bool = False, **kw):
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            return _Config(json.load(f))


def _bytes_to_unicode() -> dict[int, str]:
    # identical to transformers.models.gpt2.tokenization_gpt2.bytes_to_unicode
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class AddedToken:
    def __init__(self, content, single_word=False, lstrip=False, rstrip=False, normalized=True, special=False):
        self.content, self.single_word, self.lstrip, self.rstrip = content, single_word, lstrip, rstrip
        self.normalized, self.special = normalized, special

    def __repr__(self):
        return (f"AddedToken({self.content!r}, special={self.special}, normalized={self.normalized}, "
                f"lstrip={self.lstrip}, rstrip={self.rstrip}, single_word={self.single_word})")


class _ByteLevelBPETokenizer:
    def __init__(self, d: Path):
        with open(d / "tokenizer.json", encoding="utf-8") as f:
            tj = json.load(f)
        m = tj["model"]
        if m.get("type") != "BPE" or m.get("dropout") or m.get("byte_fallback") or m.get("continuing_subword_prefix") or m.get("end_of_word_suffix"):
            raise NotImplementedError(f"stub: unsupported tokenizer model {m.get('type')}")
        self._vocab: dict[str, int] = dict(m["vocab"])
        merges = [tuple(x.split(" ")) if isinstance(x, str) else tuple(x) for x in m["merges"]]
        self._ranks = {pair: i for i, pair in enumerate(merges)}
        self._ignore_merges = bool(m.get("ignore_merges", False))

        # normalizer
        norm = tj.get("normalizer")
        if norm is None:
            self._nfc = False
        elif norm.get("type") == "NFC":
            self._nfc = True
        else:
            raise NotImplementedError(f"stub: unsupported normalizer {norm}")

        # pre-tokenizer: Sequence[Split(regex, Isolated), ByteLevel(use_regex=False)]
        pt = tj.get("pre_tokenizer") or {}
        steps = pt["pretokenizers"] if pt.get("type") == "Sequence" else [pt]
        self._split_re = None
        for s in steps:
            if s["type"] == "Split":
                if s.get("behavior") != "Isolated" or s.get("invert"):
                    raise NotImplementedError(f"stub: unsupported Split {s}")
                self._split_re = regex.compile(s["pattern"]["Regex"])
            elif s["type"] == "ByteLevel":
                if s.get("add_prefix_space") or s.get("use_regex"):
                    raise NotImplementedError(f"stub: unsupported ByteLevel {s}")
            else:
                raise NotImplementedError(f"stub: unsupported pre-tokenizer {s}")
        self.pre_tokenizer_regex = self._split_re.pattern if self._split_re else None
        dec = tj.get("decoder") or {}
        if dec.get("type") != "ByteLevel":
            raise NotImplementedError(f"stub: unsupported decoder {dec}")

        # added tokens (tokenizer.json is what the fast tokenizer uses)
        self.added_tokens_decoder: dict[int, AddedToken] = {}
        for t in tj.get("added_tokens", []):
            if t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized"):
                raise NotImplementedError(f"stub: unsupported added token flags {t}")
            self.added_tokens_decoder[t["id"]] = AddedToken(t["content"], t["single_word"], t["lstrip"], t["rstrip"], t["normalized"], t["special"])
        # cross-check with tokenizer_config.json when present
        tc_path = d / "tokenizer_config.json"
        if tc_path.is_file():
            with open(tc_path, encoding="utf-8") as f:
                tc = json.load(f)
            for k, v in (tc.get("added_tokens_decoder") or {}).items():
                a = self.added_tokens_decoder.get(int(k))
                assert a is not None and a.content == v["content"] and a.special == v["special"], (k, v)
        self._added = {a.content: i for i, a in self.added_tokens_decoder.items()}
        self._added_re = regex.compile("|".join(regex.escape(c) for c in sorted(self._added, key=len, reverse=True))) if self._added else None

        self._b2u = _bytes_to_unicode()
        self._u2b = {u: b for b, u in self._b2u.items()}
        self._id2tok = {i: t for t, i in self._vocab.items()}
        for i, a in self.added_tokens_decoder.items():
            self._id2tok[i] = a.content

    # --- HF-like API -------------------------------------------------------
    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    def get_vocab(self) -> dict[str, int]:
        v = dict(self._vocab)
        v.update(self._added)
        return v

    def get_added_vocab(self) -> dict[str, int]:
        return {a.content: i for i, a in sorted(self.added_tokens_decoder.items())}

    def __len__(self):
        return len(self.get_vocab())

    def _bpe(self, word: str) -> list[str]:
        if self._ignore_merges and word in self._vocab:
            return [word]
        parts = list(word)
        while len(parts) > 1:
            best = None  # (rank, pos): lowest rank, then leftmost (== HF tokenizers' priority queue)
            for i in range(len(parts) - 1):
                r = self._ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def _encode_ordinary(self, text: str) -> list[int]:
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        pieces = []
        if self._split_re is None:
            pieces = [text]
        else:
            pos = 0
            for mt in self._split_re.finditer(text):
                if mt.start() > pos:
                    pieces.append(text[pos:mt.start()])  # Isolated: gaps are pieces too
                pieces.append(mt.group())
                pos = mt.end()
            if pos < len(text):
                pieces.append(text[pos:])
        ids = []
        for p in pieces:
            if not p:
                continue
            word = "".join(self._b2u[b] for b in p.encode("utf-8"))
            for tok in self._bpe(word):
                if tok not in self._vocab:
                    raise KeyError(f"stub: token {tok!r} not in vocab (no unk/byte_fallback)")
                ids.append(self._vocab[tok])
        return ids

    def encode(self, text: str, add_special_tokens: bool = True, **kw) -> list[int]:
        # post_processor is ByteLevel (no BOS/EOS template), so add_special_tokens adds nothing
        ids: list[int] = []
        pos = 0
        if self._added_re is not None:
            for mt in self._added_re.finditer(text):
                if mt.start() > pos:
                    ids += self._encode_ordinary(text[pos:mt.start()])
                ids.append(self._added[mt.group()])
                pos = mt.end()
        if pos < len(text):
            ids += self._encode_ordinary(text[pos:])
        return ids

    def decode(self, ids, skip_special_tokens: bool = False, **kw) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i in self.added_tokens_decoder:
                if skip_special_tokens and self.added_tokens_decoder[i].special:
                    continue
                out += self.added_tokens_decoder[i].content.encode("utf-8")
            else:
                out += bytes(self._u2b[c] for c in self._id2tok[i])
        return out.decode("utf-8", errors="replace")


class AutoTokenizer:
    @staticmethod
    def from_pretrained(path, trust_remote_code: bool = False, **kw):
        return _ByteLevelBPETokenizer(Path(path))
