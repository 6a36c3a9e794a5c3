"""Generation evals in this process, on the tiny real models: reading eval rows, rendering prompts with the model's
chat template and thinking setting, batched left-padded generation equal to one prompt at a time (text and
Qwen2.5-VL with images), batches that do not depend on the number of processes, seeded sampling that leaves the
training's random state alone."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tests.conftest import write_jsonl
from toolkit.builtin.dummy_data import write_dummy_vl_data
from toolkit.config.schema import GenerationEvalConfig
from toolkit.errors import ToolkitError
from toolkit.evals.generation import (
    GenerationEval,
    encode_batch,
    generate,
    generation_config,
    load_generation_eval,
    plan_batches,
    read_generation_rows,
)
from toolkit.evals.scorers import build_scorers
from toolkit.model.attention import EAGER_PACKED, SDPA_PACKED
from toolkit.model.load import load_processing
from toolkit.model.loss_head import install_loss_head
from toolkit.runtime import process as distributed

USER = {"role": "user", "content": "What is 2 + 2?"}
pytestmark = pytest.mark.usefixtures("one_thread")


def rows_of(tmp_path: Path, rows: list, *, vision: bool = False) -> list:
    return read_generation_rows(write_jsonl(tmp_path / "eval.jsonl", rows), vision=vision)


def test_eval_rows_and_their_references(tmp_path: Path) -> None:
    rows = rows_of(tmp_path, [
        {"messages": [USER], "reference": "4"},
        {"messages": [USER, {"role": "assistant", "content": "4."}]},  # a training row: its last answer
        {"messages": [USER, {"role": "assistant", "content": "4."}], "reference": "four"},
        {"prompt": "2 + 2 =", "completion": " 4"},
        {"prompt": "2 + 2 =", "tests": [1, 2]},
    ])
    assert [(where.rsplit(":", 1)[1], reference) for where, _, reference, _, _ in rows] == [
        ("1", "4"), ("2", "4."), ("3", "four"), ("4", " 4"), ("5", None)]
    assert rows[1][1] == [USER] and rows[3][1] == "2 + 2 =" and rows[4][4]["tests"] == [1, 2]


@pytest.mark.parametrize(("row", "message"), [
    ({"messages": [{"role": "assistant", "content": "4."}]}, "must end with the user (or tool) turn to answer"),
    ({"messages": [USER, {"role": "assistant", "content": "4."}, {"role": "assistant", "content": "5."}]},
     "must end with the user (or tool) turn"),
    ({"text": "2 + 2 = 4"}, "needs 'messages' (a conversation to answer) or a 'prompt' string"),
    ({"messages": [{"content": "no role"}]}, "messages[0] must have a role in"),
    ({"messages": [USER], "images": ["a.png"]}, "the row has images but the model is not a vision-language model"),
])
def test_bad_eval_rows(tmp_path: Path, row: dict, message: str) -> None:
    with pytest.raises(ToolkitError, match=r"eval.jsonl:1: ") as err:
        rows_of(tmp_path, [row])
    assert message in str(err.value)


def test_rows_without_the_reference_a_scorer_needs(tmp_path: Path, models: dict[str, str]) -> None:
    _, tokenizer = load_processing(models["text"], vision=False, trust_remote_code=False, chat_template=None)
    write_jsonl(tmp_path / "eval.jsonl", [{"messages": [USER], "reference": "4"}, {"messages": [USER]}])
    for scorers, message in ((["exact"], "eval.jsonl:2: scorer e.scorers.0 ('exact') compares with the row's "
                                         "reference, and the row has no string reference"),
                             (["regex"], None)):
        config = GenerationEvalConfig(name="e", data=[str(tmp_path / "eval.jsonl")], scorers=scorers)
        built = build_scorers(config.scorers, key="e.scorers", recipe_dir=tmp_path)
        with pytest.raises(ToolkitError) as err:
            load_generation_eval(config, built, tokenizer, stage=None, dummy_dir=tmp_path, vision=False,
                                 thinking="auto")
        assert message is None or message in str(err.value)
    write_jsonl(tmp_path / "eval.jsonl", [{"messages": [USER], "reference": "(unclosed"}])
    config = GenerationEvalConfig(name="e", data=[str(tmp_path / "eval.jsonl")], scorers=["regex"])
    with pytest.raises(ToolkitError, match=r"eval\.jsonl:1: the reference is not a valid regular expression"):
        load_generation_eval(config, build_scorers(config.scorers, key="k", recipe_dir=tmp_path), tokenizer,
                             stage=None, dummy_dir=tmp_path, vision=False, thinking="auto")
    config = GenerationEvalConfig(name="e", data=[str(tmp_path / "eval.jsonl")], scorers=["json_valid"])
    loaded = load_generation_eval(config, build_scorers(config.scorers, key="k", recipe_dir=tmp_path), tokenizer,
                                  stage=None, dummy_dir=tmp_path, vision=False, thinking="auto")
    assert len(loaded.prompts) == 1  # json_valid needs no reference


def test_prompts_use_the_models_template_and_its_thinking_setting(tmp_path: Path, qwen3_dir: Path) -> None:
    """Qwen3's stock template: answers trained without reasoning (data.thinking auto) are asked in its
    non-thinking format, the empty think block in the prompt, as training put it before the answer."""
    _, tokenizer = load_processing(str(qwen3_dir), vision=False, trust_remote_code=False, chat_template=None)
    write_jsonl(tmp_path / "eval.jsonl", [{"messages": [USER], "reference": "4"}, {"prompt": "2 + 2 =",
                                                                                 "reference": "4"}])

    def prompts(thinking: str, **settings: object) -> list[str]:
        config = GenerationEvalConfig(name="e", data=[str(tmp_path / "eval.jsonl")], scorers=["exact"], **settings)
        scorers = build_scorers(config.scorers, key="k", recipe_dir=tmp_path)
        return [p.text for p in load_generation_eval(config, scorers, tokenizer, stage=None, dummy_dir=tmp_path,
                                                     vision=False, thinking=thinking).prompts]

    head = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert prompts("auto") == [head + "<think>\n\n</think>\n\n", "2 + 2 ="]  # raw prompts stay raw
    assert prompts("none")[0] == head  # answers trained with no think block
    assert prompts("auto", enable_thinking=True)[0] == head  # the model is to think first


def test_batches_are_the_same_on_any_number_of_processes() -> None:
    batches = plan_batches(9, 4)
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    # batch k goes to rank k mod world: rank 0 gets batches 0 and 2 (5 prompts), rank 1 batch 1 (4 prompts)
    assert [batches[k] for k in range(0, 3, 2)] == [[0, 1, 2, 3], [8]]


@pytest.fixture(scope="module")
def accelerator():
    return distributed.build_accelerator(1, 10)


def evaluation(model_dir: str, path: Path, *, vision: bool = False, **settings: object):
    processing, _ = load_processing(model_dir, vision=vision, trust_remote_code=False, chat_template=None)
    config = GenerationEvalConfig(name="e", data=[str(path)], scorers=["contains"], **settings)
    scorers = build_scorers(config.scorers, key="k", recipe_dir=path.parent)
    return processing, load_generation_eval(config, scorers, processing, stage=None, dummy_dir=path.parent,
                                            vision=vision, thinking="auto")


def one_at_a_time(accelerator, model, processing, gen: GenerationEval, *, vision: bool = False) -> list[str]:
    single = GenerationEval(gen.config.model_copy(update={"batch_size": 1}), None, gen.prompts, gen.scorers)
    return [text for _, text in generate(accelerator, model, single, processing, vision=vision, lockstep=False,
                                         seed=0, step=1)]


def test_batched_left_padded_greedy_equals_one_prompt_at_a_time(tmp_path: Path, models: dict[str, str],
                                                                 accelerator) -> None:
    questions = ["What is 2 + 2?", "Reverse this list: cat, dog, tree, house, car, book, bird", "Hi",
                 "Count the words: the quick brown fox jumps over the lazy dog"]
    rows = [{"messages": [{"role": "user", "content": q}], "reference": "x"} for q in questions]
    rows.insert(2, {"prompt": "The quick brown fox", "reference": "x"})  # raw text, in the same batch
    path = write_jsonl(tmp_path / "eval.jsonl", rows)
    processing, gen = evaluation(models["text"], path, batch_size=5, max_new_tokens=12)
    assert gen.prompts[2].raw and gen.prompts[2].text == "The quick brown fox"
    model = AutoModelForCausalLM.from_pretrained(models["text"]).eval()
    batched = generate(accelerator, model, gen, processing, vision=False, lockstep=True, seed=0, step=1)
    assert [i for i, _ in batched] == [0, 1, 2, 3, 4]
    outputs = [text for _, text in batched]
    assert outputs == one_at_a_time(accelerator, model, processing, gen)
    assert len(set(outputs)) > 1 and all("<|im_end|>" not in o for o in outputs)  # special tokens decoded away


def test_decoding_is_the_evals_own_whatever_the_models_generation_config(tmp_path: Path, models: dict[str, str],
                                                                         accelerator) -> None:
    """A model whose generation_config samples with its own filters (Qwen3's: temperature 0.6, top-k 20) and
    penalises repeats is still decoded greedily, token by token the argmax; sampling uses the eval's temperature
    and top-p and no top-k the model asks for."""
    path = write_jsonl(tmp_path / "eval.jsonl", [{"messages": [USER], "reference": "4"}])
    processing, gen = evaluation(models["text"], path, batch_size=1, max_new_tokens=8)
    model = AutoModelForCausalLM.from_pretrained(models["text"]).eval()
    model.generation_config.update(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.5)
    [(_, output)] = generate(accelerator, model, gen, processing, vision=False, lockstep=False, seed=0, step=1)
    ids = processing(gen.prompts[0].text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    argmax = processing.decode(ids[0, -8:], skip_special_tokens=True)
    assert argmax.startswith(output) and output
    sampling = generation_config(model, processing, gen.config.model_copy(update={"temperature": 0.7, "top_p": 0.9}))
    assert (sampling.do_sample, sampling.temperature, sampling.top_p, sampling.top_k) == (True, 0.7, 0.9, 0)


def test_sampling_is_seeded_and_leaves_the_training_random_state_alone(tmp_path: Path, models: dict[str, str],
                                                                        accelerator) -> None:
    path = write_jsonl(tmp_path / "eval.jsonl", [{"messages": [USER], "reference": "4"}] * 3)
    processing, gen = evaluation(models["text"], path, batch_size=2, max_new_tokens=8, temperature=1.5)
    model = AutoModelForCausalLM.from_pretrained(models["text"]).eval()
    before = torch.get_rng_state()
    first = generate(accelerator, model, gen, processing, vision=False, lockstep=False, seed=7, step=3)
    assert torch.equal(torch.get_rng_state(), before)
    assert generate(accelerator, model, gen, processing, vision=False, lockstep=False, seed=7, step=3) == first
    later = generate(accelerator, model, gen, processing, vision=False, lockstep=False, seed=7, step=4)
    assert later != first  # another eval step samples anew
    assert first[0][1] != first[1][1]  # rows of a batch draw different tokens, from one seeded stream


def test_vision_language_generation_with_images(tmp_path: Path, models: dict[str, str], accelerator) -> None:
    """Tiny Qwen2.5-VL: image rows (one and two images) and a text-only row, in batches of 2 that mix them,
    equal one prompt at a time; the prompt holds the image tokens the processor expanded."""
    write_dummy_vl_data(tmp_path, 6, seed=1)
    rows = [json.loads(line) for line in (tmp_path / "vl_stage2.jsonl").read_text().splitlines()]
    mixed = [next(r for r in rows if not r.get("images")), *(r for r in rows if len(r.get("images", [])) == 1),
             *(r for r in rows if len(r.get("images", [])) == 2)][:4]
    assert {len(r.get("images", [])) for r in mixed} == {0, 1, 2}
    path = write_jsonl(tmp_path / "vl_eval.jsonl", mixed)
    processing, gen = evaluation(models["vl"], path, vision=True, batch_size=2, max_new_tokens=6)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in gen.prompts[1].text and gen.prompts[1].images
    model = AutoModelForImageTextToText.from_pretrained(models["vl"]).eval()
    batched = [text for _, text in generate(accelerator, model, gen, processing, vision=True, lockstep=True, seed=0,
                                            step=1)]
    assert batched == one_at_a_time(accelerator, model, processing, gen, vision=True)
    assert all(isinstance(o, str) for o in batched) and len(set(batched)) > 1
    # data.max_pixels bounds the images as in training (load_generation_plan passes it as image_kwargs)
    size = processing.image_processor.size
    bounded = {"images_kwargs": {"size": {"shortest_edge": size["shortest_edge"], "longest_edge": 28 * 28 * 4}}}
    full, small = (encode_batch(processing, gen.prompts[1:2], vision=True, image_kwargs=kw)["image_grid_thw"]
                   for kw in ({}, bounded))
    assert int(small.prod()) < int(full.prod())


@pytest.mark.parametrize("kernel", [SDPA_PACKED, EAGER_PACKED])
def test_generation_under_the_training_kernels_and_loss_head(tmp_path: Path, models: dict[str, str], accelerator,
                                                             kernel: str) -> None:
    """A run's evals generate with what it trains with: the toolkit's attention kernel (what attn_implementation
    auto / sdpa / eager load), the loss head's forward wrapper and a PEFT adapter. Left-padded batches take the
    kernels' stock path and equal stock sdpa one prompt at a time; `generate`, which reads the forward's signature,
    still passes position_ids and logits_to_keep (the head sees one position per row, never the whole prompt), and
    the loss head computes nothing."""
    questions = ["What is 2 + 2?", "Reverse this list: cat, dog, tree, house, car", "Hi", "Count: the quick fox"]
    path = write_jsonl(tmp_path / "eval.jsonl", [{"messages": [{"role": "user", "content": q}], "reference": "x"}
                                                 for q in questions])
    processing, gen = evaluation(models["text"], path, batch_size=4, max_new_tokens=8)
    stock = AutoModelForCausalLM.from_pretrained(models["text"], attn_implementation="sdpa").eval()
    expected = one_at_a_time(accelerator, stock, processing, gen)
    base = AutoModelForCausalLM.from_pretrained(models["text"], attn_implementation=kernel)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()  # B = 0: base outputs
    head = install_loss_head(model, "chunked", 16)
    assert head is not None and "position_ids" in inspect.signature(base.forward).parameters
    positions: list[int] = []
    given: list[bool] = []
    base.lm_head.register_forward_pre_hook(lambda _, args: positions.append(args[0].shape[1]))
    base.model.register_forward_pre_hook(lambda _, args, kwargs: given.append(kwargs.get("position_ids") is not None),
                                         with_kwargs=True)
    assert [text for _, text in generate(accelerator, model, gen, processing, vision=False, lockstep=True, seed=0,
                                         step=1)] == expected
    assert positions and set(positions) == {1} and all(given)
    assert head.calls == 0
