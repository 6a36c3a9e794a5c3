"""Generation evals: prompts read from eval files, completed by the model in batches, scored, gathered to rank 0.

Rows. An eval file is JSONL, read by `read_generation_rows` (toolkit.data's row reader and message checks):
`{"messages": [...], "reference": ...}` with the conversation ending on the user (or tool) turn to answer, or a chat
row as training reads it, whose last assistant turn is then the reference; `{"prompt": "...", "reference": ...}`
(raw text, no chat template, as prompt/completion rows train; `completion` is the reference when there is no
`reference`). Vision-language rows carry `images` as training rows do.

Prompts are rendered once, at load, with the model's own chat template (the recipe's data.chat_template when set)
and a generation prompt, and with the template's `enable_thinking` (Qwen3) set to match how answers trained.

Batches. The rows are cut into batches of `batch_size` in file order, and batch k goes to rank k mod world: every
batch holds the same prompts, padded alike, whatever the number of processes, so greedy completions equal the
single-process ones. Prompts are left-padded (`padding_side="left"`, by the tokenizer or the VL processor) and
completed by transformers' `generate` with the model's KV cache: greedy by default, or sampled with a seed per
(eval step, batch) so the training's random streams are left untouched.

No rank may hang. Under ZeRO-3 and FSDP the weights are gathered once for the eval
(toolkit.strategies.full_weights) and every rank also runs the same number of generate calls (a rank short of
batches completes batch 0 again and discards it) with `synced_gpus`, which keeps each rank stepping until all are
done: ranks with fewer rows, or whose rows finish earlier, still take part in every forward.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from transformers import GenerationConfig

from toolkit.config.schema import GenerationEvalConfig
from toolkit.data.encoding import check_messages
from toolkit.data.sources import iter_jsonl, resolve_data_paths
from toolkit.errors import ToolkitError
from toolkit.evals.scorers import Scorer


@dataclass
class Prompt:
    """One eval row, ready to generate from: the rendered prompt, its images and the reference."""

    where: str  # file:line
    text: str  # the prompt as the model sees it (chat template applied)
    reference: Any
    row: dict[str, Any]  # the file's row (user scorers get it)
    images: list[str] = field(default_factory=list)  # resolved image paths
    raw: bool = False  # a raw-text prompt: tokenised with the tokenizer's special tokens (BOS), as training does


@dataclass
class GenerationEval:
    """A generation eval: its prompts, scorers and generation settings; `stage` is the stage that defines it (None
    for eval.generation, shared by the stages)."""

    config: GenerationEvalConfig
    stage: str | None
    prompts: list[Prompt]
    scorers: list[Scorer]

    @property
    def name(self) -> str:
        return self.config.name


def read_generation_rows(path: Path, *, vision: bool) -> list[tuple[str, Any, Any, list[str], dict[str, Any]]]:
    """(file:line, prompt, reference, image paths, row) of each row of an eval file: prompt is the messages to
    answer, or raw text. The file's rows are read and their messages checked as training reads them."""
    out = []
    for lineno, row in iter_jsonl(path):
        where = f"{path}:{lineno}"
        reference = row.get("reference")
        images: list[str] = []
        if "messages" in row:
            messages = check_messages(row["messages"], where, "all", image_parts=vision)
            if messages[-1]["role"] == "assistant":
                last = messages.pop()
                if reference is None:
                    reference = last["content"]
            if not messages or messages[-1]["role"] not in ("user", "tool"):
                raise ToolkitError(f"{where}: a generation eval row's messages must end with the user (or tool) turn "
                                   "to answer, optionally followed by the reference answer as an assistant turn.")
            images = _image_paths(row, messages, path, where, vision=vision)
            prompt: Any = messages
        elif isinstance(row.get("prompt"), str):
            prompt = row["prompt"]
            if reference is None:
                reference = row.get("completion")
        else:
            raise ToolkitError(f"{where}: a generation eval row needs 'messages' (a conversation to answer) or a "
                               f"'prompt' string; found keys {sorted(row)}.")
        out.append((where, prompt, reference, images, row))
    return out


def _image_paths(row: dict[str, Any], messages: list[dict[str, Any]], path: Path, where: str, *,
                 vision: bool) -> list[str]:
    images = row.get("images", [])
    if images and not vision:
        raise ToolkitError(f"{where}: the row has images but the model is not a vision-language model.")
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise ToolkitError(f"{where}: 'images' must be a list of image paths.")
    parts = sum(p["type"] == "image" for m in messages if isinstance(m["content"], list) for p in m["content"])
    if parts != len(images):
        raise ToolkitError(f"{where}: {parts} {{\"type\": \"image\"}} placeholder(s) in 'messages' but {len(images)} "
                           "path(s) in 'images'; there must be one placeholder per image, in order.")
    resolved = [path.parent / p for p in images]
    missing = next((p for p in resolved if not p.is_file()), None)
    if missing is not None:
        raise ToolkitError(f"{where}: image file {missing} does not exist (image paths are relative to the JSONL "
                           "file's directory).")
    return [str(p) for p in resolved]


def load_generation_eval(config: GenerationEvalConfig, scorers: list[Scorer], processing: Any, *, stage: str | None,
                         dummy_dir: Path, vision: bool, thinking: str) -> GenerationEval:
    """An eval's rows read, checked against its scorers and rendered with the chat template (`processing` is the
    tokenizer, or a VL model's processor). `thinking` is data.thinking: it picks enable_thinking by default."""
    enable_thinking = config.enable_thinking
    if enable_thinking is None and thinking != "none":
        enable_thinking = False  # answers trained in the template's non-thinking format (Qwen3: an empty think block)
    template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    prompts = []
    for path in resolve_data_paths(config.data, dummy_dir):
        for where, prompt, reference, images, row in read_generation_rows(path, vision=vision):
            for scorer in scorers:
                _check_reference(scorer, reference, where)
            prompts.append(Prompt(where, _render(processing, prompt, row, where, template_kwargs), reference, row,
                                  images, raw=isinstance(prompt, str)))
    if not prompts:
        raise ToolkitError(f"generation eval '{config.name}': its files ({', '.join(config.data)}) hold no rows.")
    return GenerationEval(config, stage, prompts, scorers)


def _check_reference(scorer: Scorer, reference: Any, where: str) -> None:
    if not scorer.needs_reference:
        return
    if not isinstance(reference, str):
        raise ToolkitError(f"{where}: scorer {scorer.key} ('{scorer.name}') compares with the row's reference, and "
                           "the row has no string reference (a 'reference' key, or a last assistant turn).")
    if scorer.reference_is_pattern:
        try:
            re.compile(reference)
        except re.error as e:
            raise ToolkitError(f"{where}: the reference is not a valid regular expression ({e}); scorer "
                               f"{scorer.key} (regex without a pattern) matches the output against it.") from None


def _render(processing: Any, prompt: Any, row: dict[str, Any], where: str, template_kwargs: dict[str, Any]) -> str:
    if isinstance(prompt, str):
        return prompt
    try:
        return processing.apply_chat_template(prompt, tools=row.get("tools"), tokenize=False,
                                              add_generation_prompt=True, **template_kwargs)
    except Exception as e:  # a template's raise_exception, or Jinja errors on a shape it does not handle
        raise ToolkitError(f"{where}: the chat template could not render this prompt ({type(e).__name__}: {e}).") \
            from None


def plan_batches(num_rows: int, batch_size: int) -> list[list[int]]:
    """The eval's batches, in file order: the same on any number of processes."""
    return [list(range(start, min(start + batch_size, num_rows))) for start in range(0, num_rows, batch_size)]


def generation_config(model: Any, tokenizer: Any, config: GenerationEvalConfig) -> GenerationConfig:
    """The eval's decoding: greedy unless temperature > 0, then temperature and top-p sampling alone; stops at the
    tokenizer's or the model's end-of-sequence tokens.

    transformers fills what a passed config leaves unset from the model's own generation_config (Qwen3's samples,
    with top_k 20): every setting that changes the tokens chosen is given here, so none is inherited. The sampling
    filters are left unset when decoding greedily (they are unused, and set they would draw transformers' warning
    on every eval)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    sampling = config.temperature > 0
    filters = {"temperature": config.temperature, "top_p": config.top_p, "top_k": 0, "min_p": 0.0,
               "typical_p": 1.0} if sampling else {}
    return GenerationConfig(max_new_tokens=config.max_new_tokens, do_sample=sampling, num_beams=1,
                            repetition_penalty=1.0, no_repeat_ngram_size=0, **filters,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids, use_cache=True)


def encode_batch(processing: Any, prompts: list[Prompt], *, vision: bool, image_kwargs: dict[str, Any]
                 ) -> dict[str, torch.Tensor]:
    """The batch's prompts as left-padded tensors (with pixel values for VL rows, image tokens expanded by the
    processor)."""
    texts = [p.text for p in prompts]
    if not vision:  # a rendered chat prompt holds its special tokens already; a raw one gets them as training does
        ids = [processing(p.text, add_special_tokens=p.raw)["input_ids"] for p in prompts]
        return processing.pad({"input_ids": ids}, padding=True, padding_side="left", return_tensors="pt")
    from toolkit.data.vision import _load_image  # VL runs only

    images = [_load_image(Path(path), p.where) for p in prompts for path in p.images]
    return processing(text=texts, images=images or None, padding=True, padding_side="left", return_tensors="pt",
                      return_mm_token_type_ids=True, **image_kwargs)


@torch.no_grad()
def generate(accelerator: Accelerator, model: Any, evaluation: GenerationEval, processing: Any, *, vision: bool,
             lockstep: bool, seed: int, step: int, image_kwargs: dict[str, Any] | None = None
             ) -> list[tuple[int, str]]:
    """(row index, completion) of this rank's share of the eval's rows. `model` holds its full weights (see
    toolkit.strategies.full_weights); with `lockstep` every rank runs as many generate calls, and each call steps
    until every rank's rows are done."""
    tokenizer = getattr(processing, "tokenizer", processing)
    config = evaluation.config
    batches = plan_batches(len(evaluation.prompts), config.batch_size)
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(range(rank, len(batches), world))
    rounds = math.ceil(len(batches) / world) if lockstep else len(mine)
    settings = generation_config(model, tokenizer, config)
    out: list[tuple[int, str]] = []
    for r in range(rounds):
        number = mine[r] if r < len(mine) else None  # None: this rank only keeps the others company
        rows = batches[number if number is not None else 0]
        inputs = encode_batch(processing, [evaluation.prompts[i] for i in rows], vision=vision,
                              image_kwargs=image_kwargs or {})
        inputs = {k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        with _seeded(accelerator, seed, step, number if number is not None else 0, sampling=settings.do_sample):
            sequences = model.generate(**inputs, generation_config=settings,
                                       synced_gpus=lockstep and accelerator.num_processes > 1)
        if number is None:
            continue
        new = sequences[:, inputs["input_ids"].shape[1]:]
        out += zip(rows, tokenizer.batch_decode(new, skip_special_tokens=True), strict=True)
    return out


class _seeded:
    """Sampling draws from a stream seeded by (run seed, step, batch), forked from the global one: the training's
    random state is untouched and a batch samples alike on whichever rank runs it. Greedy decoding draws nothing."""

    def __init__(self, accelerator: Accelerator, seed: int, step: int, batch: int, *, sampling: bool) -> None:
        self.fork = None
        if sampling:
            devices = [accelerator.device] if accelerator.device.type == "cuda" else []
            self.fork = torch.random.fork_rng(devices=devices)
            self.seed = (seed * 1_000_003 + step) * 1_000_003 + batch

    def __enter__(self) -> None:
        if self.fork is not None:
            self.fork.__enter__()
            torch.manual_seed(self.seed % 2**63)

    def __exit__(self, *exc: object) -> None:
        if self.fork is not None:
            self.fork.__exit__(*exc)


def score_rows(evaluation: GenerationEval, completions: list[tuple[int, str]]) -> tuple[list[dict[str, Any]],
                                                                                        str | None]:
    """Each completion's record (row, output, scores) and the first scorer error on this rank, if any: the error is
    carried to rank 0 rather than raised, so no rank stops while the others wait on it."""
    records = []
    for index, output in completions:
        prompt = evaluation.prompts[index]
        try:
            scores = {s.name: s(output, prompt.reference, prompt.row, prompt.where) for s in evaluation.scorers}
        except ToolkitError as e:
            return records, str(e)
        records.append({"index": index, "output": output, "score": scores})
    return records, None


def gather_records(records: list[dict[str, Any]], error: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Every rank's records (in row order) and the first error of any rank; collective (all ranks get them)."""
    parts = gather_object([(records, error)])
    error = next((e for _, e in parts if e is not None), None)
    return sorted((r for rs, _ in parts for r in rs), key=lambda r: r["index"]), error
