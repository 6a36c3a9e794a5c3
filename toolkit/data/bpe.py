"""A tiktoken twin of a byte-level BPE fast tokenizer, used only where it provably gives the same tokens.

Why a second tokenizer: after the direct renderers (render.py), the HF tokenizer's batch call is about three
quarters of preparing chat rows, and tiktoken's BPE (also Rust, OpenAI's) encodes Qwen's text several times faster
with the same ids (docs/benchmarks.md, issue 52). The Qwen2.5 / Qwen3 / Qwen-VL tokenizers come from tiktoken ranks:
byte-level BPE after a Split regex, their merges ranked by the merged token's id (the hub's files keep one merge
per token; transformers' `TikTokenConverter` writes every split of every token).

The two BPEs differ in one way: tiktoken merges the lowest-ranked adjacent pair whose bytes form *any* token, HF
only pairs listed as merges (lowest listed first). They give the same tokens on every word when
  (a) every merge forms a token from two tokens, and the merges are listed in the order of the merged token's id;
  (b) every token's own bytes are built back into that token by the merges alone.
Why: a greedy BPE builds a token inside a word only from the bytes under it, and, until it is built, exactly as it
would build it from those bytes alone (a merge that reaches outside them would leave it unbuilt). So, by (b) and
induction on length, each merge tiktoken makes inside a word is the last merge of that token's own build, which HF
lists; with (a), both pick the same pair at every step. (b) also covers tiktoken's shortcut of taking a word that
is a token whole. `BpeTwin.of` checks (a) on every merge and (b) on every token of ASCII bytes, the only ones an
ASCII text builds, and also that:
  * the model has no dropout, byte fallback, unknown token, prefixes or suffixes; the pre-tokenizer is one Split
    regex then byte-level; the normalizer is NFC or none (the identity on ASCII);
  * added tokens strip nothing, are not single-word, sit outside the BPE's ids and are not a prefix of one another
    (tiktoken splits them out by the first alternative that matches, HF by the longest).
The first condition missing is logged once, and the HF tokenizer does everything. Per text (`encode`), the twin
takes ASCII only: there NFC changes nothing, bytes are characters (the offsets of the masks), and the two regex
engines (Oniguruma in HF, fancy-regex in tiktoken) read the same classes; tests/data/test_bpe.py checks the regex
on every pair and triple of ASCII classes, and the ids on every test asset and on generated rows. Other texts go
to the HF tokenizer.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

TWIN_MIN_ROWS = 5000
"""Preparations of fewer rows keep the fast tokenizer alone: building the twin (about 1-2 s for Qwen's 150k
tokens, once per preparation) costs more than it saves below a few thousand rows (it saves about 0.3 ms a row)."""
_TWINS: dict[str, BpeTwin | None] = {}
"""By the tokenizer's serialisation, in this process (forked workers inherit it): a launch's other files reuse it.
Qwen's holds about 35 MB of the preparing rank's memory."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what the ByteLevel pre-tokenizer maps each byte to), as transformers has it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


class BpeTwin:
    """tiktoken's Encoding of the same ranks, pattern and added tokens, and each token's length in bytes."""

    def __init__(self, encoding: Any, lengths: np.ndarray) -> None:
        self.encoding = encoding
        self.lengths = lengths  # int64 per id: bytes in the token (added tokens included)
        self.special = frozenset(encoding.special_tokens_set)  # split out as the HF tokenizer splits added tokens

    @classmethod
    def of(cls, tokenizer: Any, key: str | None = None) -> BpeTwin | None:
        """The tokenizer's twin, built once per process (None: the tokenizer is not one the twin equals, or
        tiktoken is not installed; the reason is logged once). `key`: a digest of everything the twin depends on
        (the token store's tokenizer fingerprint), else one is taken of the tokenizer's serialisation, so a
        tokenizer changed in place is never served a stale twin."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        text = None
        if key is None:
            text = backend.to_str()
            added = sorted((i, str(t)) for i, t in tokenizer.added_tokens_decoder.items())
            key = hashlib.sha256(f"{text}{added}".encode()).hexdigest()
        if key not in _TWINS:
            with _gc_paused():
                twin, why = _build(tokenizer, backend.to_str() if text is None else text)
            if twin is None:
                log.info("data: chat rows tokenised by the fast tokenizer alone (its tiktoken twin is not used: "
                         "%s)", why)
            else:
                log.info("data: chat rows tokenised by the fast tokenizer's tiktoken twin (the same ids)")
            _TWINS[key] = twin
        return _TWINS[key]

    def encode(self, text: str) -> np.ndarray | None:
        """The text's ids (int32), no special tokens added; None where the twin does not take it (not ASCII)."""
        if not text.isascii():
            return None
        # tiktoken's buffer as it is (no Python list of ints); ids are far below 2**31, so int32 reads them unchanged
        return self.encoding.encode_to_numpy(text, allowed_special=self.special, disallowed_special=()).view(np.int32)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off: building makes about a million small acyclic objects (the vocabulary, the
    merges), and each collection they trigger walks the whole process's heap (parsing Qwen's tokenizer took 2.3 s
    with it, 0.3 s without, in a process that had imported transformers)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _build(tokenizer: Any, text: str) -> tuple[BpeTwin | None, str]:
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    spec = _loads(text)
    why = _refusal(spec)
    if why:
        return None, why
    model = spec["model"]
    # Each byte-level character back to its byte: str.translate then latin-1, at C speed (0.05 s for 150k tokens)
    back = str.maketrans({c: chr(b) for b, c in _bytes_to_unicode().items()})
    try:
        ranks = {token.translate(back).encode("latin-1"): i for token, i in model["vocab"].items()}  # in order
    except UnicodeEncodeError:
        return None, "a token holds a character outside the byte-level alphabet"
    if len(ranks) != len(model["vocab"]) or sorted(ranks.values()) != list(range(len(ranks))):
        return None, "the vocabulary's ids are not 0..n-1 over distinct byte strings"
    added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
    if any(t.lstrip or t.rstrip or t.single_word for t in tokenizer.added_tokens_decoder.values()):
        return None, "an added token strips whitespace or matches single words"
    names = sorted(added)
    if any(b.startswith(a) for a, b in itertools.pairwise(names)):
        return None, "an added token is a prefix of another"
    if any(i < len(ranks) for i in added.values()):
        return None, "an added token has an id inside the BPE vocabulary"
    unbuilt = _unbuilt_tokens(model, [t for t, raw in zip(model["vocab"], ranks, strict=True) if raw.isascii()])
    if unbuilt:
        return None, f"{unbuilt} token(s) are not built back from their own bytes by the merges (e.g. {unbuilt[0]!r})"
    pattern = _split_pattern(spec)
    assert pattern is not None
    encoding = tiktoken.Encoding("twin", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens=added)
    size = max([len(ranks) - 1, *added.values()]) + 1
    lengths = np.zeros(size, dtype=np.int64)
    for token, i in ranks.items():
        lengths[i] = len(token)
    for token, i in added.items():
        lengths[i] = len(token.encode())
    return BpeTwin(encoding, lengths), ""


def _loads(text: str) -> Any:
    """JSON by orjson where installed (a 150k-token tokenizer: 0.2 s against json's 0.9 s)."""
    try:
        import orjson
    except ImportError:
        return json.loads(text)
    return orjson.loads(text)


def _split_pattern(spec: dict[str, Any]) -> str | None:
    """The Split regex of a `Sequence([Split(regex, isolated), ByteLevel(use_regex=false)])` pre-tokenizer."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not parts or len(parts) != 2:
        return None
    split, level = parts
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    if level.get("type") != "ByteLevel" or level.get("use_regex") or level.get("add_prefix_space"):
        return None
    return (split.get("pattern") or {}).get("Regex")


def _refusal(spec: dict[str, Any]) -> str:
    """Why the serialised tokenizer is not one tiktoken equals ('' when it is)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"the model is {model.get('type')}, not BPE"
    if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix") or model.get("unk_token"):
        return "the BPE has dropout, byte fallback, an unknown token, or word prefixes / suffixes"
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"the normalizer is {normalizer.get('type')} (the twin takes none or NFC)"
    if _split_pattern(spec) is None:
        return "the pre-tokenizer is not one Split regex then byte-level"
    vocab, merges = model["vocab"], model["merges"]
    last = -1
    for m in merges:
        left, right = m if isinstance(m, list) else m.split(" ", 1)
        merged = vocab.get(left + right)
        if merged is None or left not in vocab or right not in vocab:
            return f"the merge {left!r} + {right!r} does not form a token from two tokens"
        if merged < last:
            return "the merges are not listed in the order of the merged token's id"
        last = merged
    return ""


def _unbuilt_tokens(model: dict[str, Any], tokens: list[str]) -> list[str]:
    """The tokens of `tokens` that the BPE's merges alone (no whole-word shortcut) do not build from their own
    bytes, in the byte-level alphabet."""
    from tokenizers import models

    bpe = models.BPE(vocab=model["vocab"], merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
                                                   for m in model["merges"]], ignore_merges=False)
    vocab = model["vocab"]
    return [t for t in tokens if len(t) > 1 and [x.id for x in bpe.tokenize(t)] != [vocab[t]]]
