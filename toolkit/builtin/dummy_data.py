"""Deterministic dummy chat datasets for curriculum smoke runs, text (`write_dummy_data`) and image-text
(`write_dummy_vl_data`).

Smoke runs need two stages of easy-to-learn chat data without downloads: stage 1 is short single-turn
arithmetic; stage 2 is longer, partly multi-turn, partly system-prompted text with a long tail of
lengths (to exercise packing/bucketing). Each row carries a ``difficulty`` that grows with problem size
so difficulty-ordered curricula have something to sort on. The image-text stages ask about small generated
PNGs (colours and shapes), mixed with text-only rows; `vl_video` adds rows with videos (frame lists of PNGs, which
need no video decoder) and images across turns (`write_dummy_vl_video`). A preference stage gets arithmetic pairs:
the right answer chosen, a wrong one rejected (`write_dummy_pairs`). An RL stage gets prompts with references that
a tiny random model can learn to satisfy (`write_dummy_letters`).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, ImageDraw

from toolkit.atomic import write_atomic, write_text_atomic

if TYPE_CHECKING:
    from toolkit.config.schema import StageConfig

Row = dict[str, Any]

_NAMES = ["Sam", "Mia", "Tom", "Ana", "Leo", "Eva", "Max", "Zoe"]
_ITEMS = ["apples", "books", "cats", "coins", "cards", "pens", "boxes", "eggs"]
_WORDS = ["cat", "dog", "tree", "house", "car", "book", "red", "blue", "sun", "fish", "bird", "apple"]
_SYSTEMS = [
    "You are a careful assistant. Answer briefly.",
    "You are a helpful math tutor. Show each step.",
    "Follow the instructions exactly.",
]


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _arith(rng: random.Random, max_digits: int) -> tuple[str, str, float]:
    """Return (question, answer, difficulty) for a +/- problem; difficulty ~ log10 of operand size."""
    a = rng.randint(0, 10 ** rng.randint(1, max_digits) - 1)
    b = rng.randint(0, 10 ** rng.randint(1, max_digits) - 1)
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    return f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}.", math.log10(1 + max(a, b))


def _long_tail(rng: random.Random, scale: int = 3, cap: int = 60) -> int:
    """Mostly small sizes with occasional ones several times larger (Pareto tail)."""
    return min(cap, max(2, int(rng.paretovariate(1.3) * scale)))


def _stage1_row(rng: random.Random) -> Row:
    question, answer, difficulty = _arith(rng, max_digits=2)
    return {
        "messages": [_msg("user", question), _msg("assistant", answer)],
        "difficulty": round(difficulty, 3),
    }


def _stage2_row(rng: random.Random) -> Row:
    kind = rng.randrange(4)
    messages: list[dict[str, str]] = []
    if kind == 0:  # multi-step word problem
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        c = rng.randint(0, a + b)
        total, left = a + b, a + b - c
        messages += [
            _msg("user", f"{name} has {a} {item}, gets {b} more, then gives away {c}. How many {item} now?"),
            _msg("assistant", f"{a} + {b} = {total}. {total} - {c} = {left}. {name} has {left} {item}."),
        ]
        difficulty = 2.0 + math.log10(1 + total)
    elif kind == 1:  # reverse a word list
        words = [rng.choice(_WORDS) for _ in range(_long_tail(rng))]
        messages += [
            _msg("user", "Reverse this list: " + ", ".join(words)),
            _msg("assistant", ", ".join(reversed(words))),
        ]
        difficulty = float(len(words))
    elif kind == 2:  # count words, enumerating them
        words = [rng.choice(_WORDS) for _ in range(_long_tail(rng))]
        steps = ", ".join(f"{i} {w}" for i, w in enumerate(words, 1))
        messages += [
            _msg("user", "Count the words: " + " ".join(words)),
            _msg("assistant", f"{steps}. There are {len(words)} words."),
        ]
        difficulty = float(len(words))
    else:  # multi-turn arithmetic follow-up
        question, answer, difficulty = _arith(rng, max_digits=3)
        value = int(answer.rsplit("= ", 1)[1].rstrip("."))
        d = rng.randint(1, 99)
        messages += [
            _msg("user", question),
            _msg("assistant", answer),
            _msg("user", f"Now add {d} to that."),
            _msg("assistant", f"{value} + {d} = {value + d}."),
        ]
        difficulty += 1.0
    if rng.random() < 0.3:
        messages.insert(0, _msg("system", rng.choice(_SYSTEMS)))
    return {"messages": messages, "difficulty": round(difficulty, 3)}


def write_dummy_data(out_dir: str | Path, num_samples: int, *, seed: int = 0) -> dict[str, Path]:
    """Write ``stage1.jsonl`` and ``stage2.jsonl`` with ``num_samples`` rows each; return their paths."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths: dict[str, Path] = {}
    for stage, make_row in (("stage1", _stage1_row), ("stage2", _stage2_row)):
        path = out / f"{stage}.jsonl"
        rows = [json.dumps(make_row(rng), ensure_ascii=False) for _ in range(num_samples)]
        # Atomic: several processes (one per node) may write the same file at once, and runs read it.
        write_text_atomic(path, "\n".join(rows) + "\n")
        paths[stage] = path
    return paths


def _pair_row(rng: random.Random) -> Row:
    """A preference pair in TRL's explicit conversational shape: an arithmetic question, its right answer chosen
    and a wrong one (off by 1 to 9, or the operands swapped for a subtraction) rejected."""
    question, answer, difficulty = _arith(rng, max_digits=2)
    head, value = answer.rsplit("= ", 1)
    right = int(value.rstrip("."))
    wrong = right + rng.choice([-1, 1]) * rng.randint(1, 9)
    return {"prompt": [_msg("user", question)], "chosen": [_msg("assistant", answer)],
            "rejected": [_msg("assistant", f"{head}= {wrong}.")], "difficulty": round(difficulty, 3)}


def write_dummy_pairs(out_dir: str | Path, num_samples: int, *, seed: int = 0) -> Path:
    """Write ``pairs.jsonl``: ``num_samples`` preference pairs (`_pair_row`) for a preference stage (`dummy:pairs`);
    return its path. Seeded apart from the SFT files, so adding it changes none of their rows."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"pairs-{seed}")
    path = out / "pairs.jsonl"
    write_text_atomic(path, "".join(json.dumps(_pair_row(rng)) + "\n" for _ in range(num_samples)))
    return path


def write_dummy_kto(out_dir: str | Path, num_samples: int, *, seed: int = 0) -> Path:
    """Write ``kto.jsonl``: ``num_samples`` unpaired rows for a kto stage (`dummy:kto`), TRL's `{prompt, completion,
    label}`: the k-th pair of `_pair_row` gives its chosen answer (label true) for two k in three and its rejected
    one (false) for the third, conversational, and every fourth row in the standard (string) shape; return its
    path."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"kto-{seed}")
    rows = []
    for k in range(num_samples):
        pair = _pair_row(rng)
        desirable = k % 3 != 2
        prompt, completion = pair["prompt"], pair["chosen" if desirable else "rejected"]
        if k % 4 == 3:  # standard: the texts alone
            prompt, completion = prompt[0]["content"], " " + completion[0]["content"]
        rows.append({"prompt": prompt, "completion": completion, "label": desirable})
    path = out / "kto.jsonl"
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


# --- RL prompts with references: a task the tiny random model can learn --------------------------------------------

LETTERS_BY_FREQUENCY = "etaoinshrdlcumwfgypbvkjxqz"
"""English letters, most frequent first (the order of the usual letter-frequency tables): the rarer the letter, the
fewer tokens of a BPE vocabulary hold it, and the harder the letters task."""
_LETTER_PROMPTS = ("Write a word with the letter {}.", "Say something that contains the letter {}.",
                   "Give me a word containing '{}'.")


def _letter_row(rng: random.Random) -> Row:
    """A prompt-only row (TRL's conversational shape) asking for text that holds a letter; the letter is the
    reference (the `contains` reward, `lower: true`, scores it). A random model's completion holds a common letter
    often and a rare one seldom: on the tiny Qwen3's vocabulary about 59% for `e` and 2% for `j` in 4 tokens, so the
    task has a spread of pass rates to learn from and to order by."""
    letter = rng.choice(LETTERS_BY_FREQUENCY)
    return {"prompt": [_msg("user", rng.choice(_LETTER_PROMPTS).format(letter))], "reference": letter,
            "difficulty": round(LETTERS_BY_FREQUENCY.index(letter) / (len(LETTERS_BY_FREQUENCY) - 1), 3)}


def write_dummy_letters(out_dir: str | Path, num_samples: int, *, seed: int = 0) -> Path:
    """Write ``letters.jsonl``: ``num_samples`` prompt-only rows with references (`_letter_row`) for an RL stage
    (`dummy:letters`); return its path. Seeded apart from the other files, so adding it changes none of their rows."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"letters-{seed}")
    path = out / "letters.jsonl"
    write_text_atomic(path, "".join(json.dumps(_letter_row(rng)) + "\n" for _ in range(num_samples)))
    return path


# --- facts to memorise, then overwrite (generation evals, gates, forgetting) ----------------------------------------

FACT_SUBJECTS = ("cat", "dog", "tree", "house", "car", "book", "bird", "apple", "fish")


def _fact_row(subject: str, revised: bool) -> Row:
    answer = "red" if revised else "blue"
    return {"messages": [_msg("user", f"What colour is the {subject}?"), _msg("assistant", answer)]}


def write_dummy_facts(out_dir: str | Path, num_samples: int) -> dict[str, Path]:
    """Data that a tiny model learns in a few steps and that a later stage overwrites, for generation evals, mastery
    gates and the forgetting matrix: the same nine questions ("What colour is the cat?"), answered "blue" in
    `facts.jsonl` and "red" in `facts_revised.jsonl` (training files of `num_samples` rows, cycling through the
    questions), and each question once with its answer in `facts_eval.jsonl` and `facts_revised_eval.jsonl` (nine
    prompts: generation batches split unevenly over ranks)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, revised in (("facts", False), ("facts_revised", True)):
        for file, count in ((name, num_samples), (f"{name}_eval", len(FACT_SUBJECTS))):
            rows = [_fact_row(FACT_SUBJECTS[i % len(FACT_SUBJECTS)], revised) for i in range(count)]
            paths[file] = out / f"{file}.jsonl"
            write_text_atomic(paths[file], "".join(json.dumps(r) + "\n" for r in rows))
    return paths


# --- image-text (vision-language) dummy data ------------------------------------------------------------------------

_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220), "yellow": (240, 220, 40),
    "black": (10, 10, 10), "white": (245, 245, 245), "orange": (250, 140, 20), "purple": (140, 50, 170),
}
_SHAPES = ("square", "circle", "triangle")


def _draw(path: Path, rng: random.Random) -> tuple[str, str]:
    """Write a small PNG (56-112 px a side): a coloured shape on a grey background, or a solid colour."""
    colour = rng.choice(list(_COLOURS))
    shape = rng.choice((*_SHAPES, "solid"))
    w, h = rng.randint(56, 112), rng.randint(56, 112)
    img = Image.new("RGB", (w, h), _COLOURS[colour] if shape == "solid" else (128, 128, 128))
    draw = ImageDraw.Draw(img)
    box = (w // 6, h // 6, w - w // 6, h - h // 6)
    if shape == "square":
        draw.rectangle(box, fill=_COLOURS[colour])
    elif shape == "circle":
        draw.ellipse(box, fill=_COLOURS[colour])
    elif shape == "triangle":
        draw.polygon([(w // 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=_COLOURS[colour])
    write_atomic(path, lambda f: img.save(f, format="PNG"))  # another node may be reading it (shared disk)
    return colour, shape


def _user(n_images: int, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [*({"type": "image"} for _ in range(n_images)), {"type": "text", "text": text}]}


def write_dummy_vl_data(out_dir: str | Path, num_samples: int, *, seed: int = 0) -> dict[str, Path]:
    """Deterministic two-stage VL curriculum: `vl_stage1.jsonl` (captioning, one image a row) and `vl_stage2.jsonl`
    (~30% text-only rows, the rest one or two images). Images go to `out_dir/images`; returns the JSONL paths."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    def image(name: str) -> tuple[str, str, str]:
        colour, shape = _draw(out / "images" / name, rng)
        return f"images/{name}", colour, shape

    stage1, stage2 = [], []
    for i in range(num_samples):
        path, colour, _ = image(f"s1_{i:05d}.png")
        stage1.append({"messages": [_user(1, "What colour is this?"),
                                    {"role": "assistant", "content": f"It is {colour}."}],
                       "images": [path], "difficulty": 1.0})
    for i in range(num_samples):
        kind = rng.random()
        if kind < 0.3:  # text only
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            stage2.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                        {"role": "assistant", "content": f"{a} + {b} = {a + b}."}],
                           "difficulty": 1.0})
        elif kind < 0.75:
            path, colour, shape = image(f"s2_{i:05d}_0.png")
            answer = f"A {colour} {shape}." if shape != "solid" else f"Only {colour}, no shape."
            stage2.append({"messages": [_user(1, "What shape is this, and what colour?"),
                                        {"role": "assistant", "content": answer}],
                           "images": [path], "difficulty": 2.0})
        else:
            (p0, c0, _), (p1, c1, _) = image(f"s2_{i:05d}_0.png"), image(f"s2_{i:05d}_1.png")
            answer = f"Yes, both are {c0}." if c0 == c1 else f"No: the first is {c0} and the second is {c1}."
            stage2.append({"messages": [_user(2, "Are these the same colour?"),
                                        {"role": "assistant", "content": answer}],
                           "images": [p0, p1], "difficulty": 3.0})
    paths = {}
    for name, rows in (("vl_stage1", stage1), ("vl_stage2", stage2)):
        paths[name] = out / f"{name}.jsonl"
        write_text_atomic(paths[name], "".join(json.dumps(r) + "\n" for r in rows))
    return paths


_DIRECTIONS = ("right", "left")
VIDEO_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 64 * 64}
"""Each dummy video's own frame size bounds (qwen-vl-utils' per-video settings): its 56x56 frames stay 56x56 on
Qwen2.5-VL (28-px merged patches) and become 64x64 on Qwen3-VL (32-px), 4 tokens a frame pair, instead of
qwen-vl-utils' default floor of 128 tokens a frame pair, so the rows fit a smoke recipe's max_seq_len."""


def _clip(folder: Path, rng: random.Random) -> tuple[list[str], str, str]:
    """A frame-list video (ms-swift's and qwen-vl-utils' list of frame images; PNGs, so no video decoder is needed):
    3 or 4 frames of 56x56 px, a coloured square crossing a grey background left to right or right to left.
    Returns the frame paths (relative to the data folder), the colour and the direction."""
    colour, direction = rng.choice(list(_COLOURS)), rng.choice(_DIRECTIONS)
    n = rng.choice((3, 4))  # an odd count is padded with its last frame (qwen-vl-utils' rule)
    paths = []
    for k in range(n):
        img = Image.new("RGB", (56, 56), (128, 128, 128))
        x = 4 + k * 32 // (n - 1) if direction == "right" else 36 - k * 32 // (n - 1)
        ImageDraw.Draw(img).rectangle((x, 18, x + 16, 34), fill=_COLOURS[colour])
        write_atomic(folder / f"{k}.png", lambda f, img=img: img.save(f, format="PNG"))  # makes the folder
        paths.append(f"videos/{folder.name}/{k}.png")
    return paths, colour, direction


def write_dummy_vl_video(out_dir: str | Path, num_samples: int, *, seed: int = 0) -> Path:
    """`vl_video.jsonl`: rows with videos, and images across turns, in equal shares: a video; an image and a video in
    one turn; an image in each of two user turns; a video in the first turn and an image in the second. Videos are
    frame lists under `out_dir/videos` (each with `VIDEO_PIXELS`), images go to `out_dir/images`. Multi-image rows
    in one turn are `vl_stage2`'s. Returns the JSONL path."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)  # not vl_stage2's stream: that file keeps its rows

    def clip(i: int) -> tuple[dict[str, Any], str, str]:
        frames, colour, direction = _clip(out / "videos" / f"v{i:05d}", rng)
        return {"video": frames, **VIDEO_PIXELS}, colour, direction

    def image(name: str) -> tuple[str, str, str]:
        colour, shape = _draw(out / "images" / name, rng)
        return f"images/{name}", colour, shape

    def turn(parts: tuple[str, ...], text: str) -> dict[str, Any]:
        return {"role": "user", "content": [*({"type": p} for p in parts), {"type": "text", "text": text}]}

    def said(text: str) -> dict[str, str]:
        return {"role": "assistant", "content": text}

    where = "Where does the square go?"
    rows = []
    for i in range(num_samples):
        kind = i % 4
        if kind == 0:
            video, colour, direction = clip(i)
            rows.append({"messages": [turn(("video",), where), said(f"The {colour} square moves {direction}.")],
                         "videos": [video], "difficulty": 2.0})
        elif kind == 1:
            (path, c0, _), (video, c1, _) = image(f"v{i:05d}_0.png"), clip(i)
            answer = f"Yes, both are {c0}." if c0 == c1 else f"No: the picture is {c0} and the square is {c1}."
            rows.append({"messages": [turn(("image", "video"), "Is the square in the clip the picture's colour?"),
                                      said(answer)], "images": [path], "videos": [video], "difficulty": 3.0})
        elif kind == 2:
            (p0, c0, _), (p1, c1, _) = image(f"v{i:05d}_0.png"), image(f"v{i:05d}_1.png")
            rows.append({"messages": [turn(("image",), "What colour is this?"), said(f"It is {c0}."),
                                      turn(("image",), "And this one?"), said(f"It is {c1}.")],
                         "images": [p0, p1], "difficulty": 3.0})
        else:
            (video, colour, direction), (path, _, shape) = clip(i), image(f"v{i:05d}_0.png")
            rows.append({"messages": [turn(("video",), where), said(f"The {colour} square moves {direction}."),
                                      turn(("image",), "What shape is in this picture?"),
                                      said(f"A {shape}." if shape != "solid" else "None, it is one colour.")],
                         "images": [path], "videos": [video], "difficulty": 4.0})
    path = out / "vl_video.jsonl"
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_dummy_vl_pairs(out_dir: str | Path, num_samples: int, *, seed: int = 0) -> Path:
    """`vl_pairs.jsonl`: vision preference pairs in TRL's conversational vision shape (`images`, `videos`, `prompt`,
    `chosen`, `rejected`), whose prompts hold, in equal shares, an image; a video; an image and a video. The right
    answer is chosen, a wrong one rejected (another colour, the other direction, the other verdict). Videos are
    frame lists under `out_dir/videos` (each with `VIDEO_PIXELS`), images go to `out_dir/images`, named apart from
    the other VL files'. Seeded apart from them, so adding it changes none of their rows. Returns the JSONL path."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"vl-pairs-{seed}")

    def user(parts: tuple[str, ...], text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [*({"type": p} for p in parts), {"type": "text", "text": text}]}]

    def said(text: str) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

    rows = []
    for i in range(num_samples):
        kind = i % 3
        media: dict[str, Any] = {}
        if kind != 1:
            colour, _ = _draw(out / "images" / f"p{i:05d}.png", rng)
            media["images"] = [f"images/p{i:05d}.png"]
        if kind != 0:
            frames, square, direction = _clip(out / "videos" / f"p{i:05d}", rng)
            media["videos"] = [{"video": frames, **VIDEO_PIXELS}]
        if kind == 0:
            wrong = rng.choice([c for c in _COLOURS if c != colour])
            prompt, good, bad = user(("image",), "What colour is this?"), f"It is {colour}.", f"It is {wrong}."
        elif kind == 1:
            other = _DIRECTIONS[1 - _DIRECTIONS.index(direction)]
            prompt = user(("video",), "Where does the square go?")
            good, bad = f"The {square} square moves {direction}.", f"The {square} square moves {other}."
        else:
            same = colour == square
            prompt = user(("image", "video"), "Is the square in the clip the picture's colour?")
            good, bad = ("Yes." if same else "No."), ("No." if same else "Yes.")
        rows.append({**media, "prompt": prompt, "chosen": said(good), "rejected": said(bad),
                     "difficulty": float(kind + 1)})
    path = out / "vl_pairs.jsonl"
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


DUMMY_PREFIX = "dummy:"
"""A data entry `dummy:NAME` reads the generated file NAME.jsonl (`write_dummy_files`)."""
DUMMY_PAIRS = DUMMY_PREFIX + "pairs"
DUMMY_KTO = DUMMY_PREFIX + "kto"
DUMMY_LETTERS = DUMMY_PREFIX + "letters"
"""The generated preference pairs (`write_dummy_pairs`), a preference stage's dummy data."""


def use_dummy_data(stages: list[StageConfig], *, vision: bool) -> None:
    """`--create_dummy_data`: stages not already on dummy data train on the generated files (image-text ones for a
    vision-language model), stage 1 on the first file, later stages on the second, a preference stage
    (objective dpo, orpo, simpo) on the pairs (`dummy:pairs`), a kto stage on unpaired rows (`dummy:kto`) and an RL
    stage (grpo) on the letters
    (`dummy:letters`). Changes the recipe's stages, so the saved recipe.yaml
    names the files the run read."""
    first, second = ("dummy:vl_stage1", "dummy:vl_stage2") if vision else ("dummy:stage1", "dummy:stage2")
    for i, stage in enumerate(stages):
        if not all(path.startswith(DUMMY_PREFIX) for path in stage.paths):
            objective = getattr(stage, "objective", "sft")
            chosen = DUMMY_LETTERS if objective == "grpo" else DUMMY_KTO if objective == "kto" else \
                DUMMY_PAIRS if objective != "sft" else first if i == 0 else second
            stage.data = [chosen]  # type: ignore[list-item]


def write_dummy_files(dummy_dir: Path, num_samples: int, *, seed: int, vision: bool) -> None:
    """The generated dummy data files (`dummy:NAME` entries): text ones, and image-text and video ones for a VL
    model."""
    write_dummy_data(dummy_dir, num_samples, seed=seed)
    write_dummy_facts(dummy_dir, num_samples)
    write_dummy_pairs(dummy_dir, num_samples, seed=seed)
    write_dummy_kto(dummy_dir, num_samples, seed=seed)
    write_dummy_letters(dummy_dir, num_samples, seed=seed)
    if vision:
        write_dummy_vl_data(dummy_dir, num_samples, seed=seed)
        write_dummy_vl_video(dummy_dir, num_samples, seed=seed)
        # a quarter as many vision pairs: a preference stage scores all its pairs (the reference pass) before its
        # first step, and a smoke run's trains on a few
        write_dummy_vl_pairs(dummy_dir, max(num_samples // 4, 1), seed=seed)
