"""Rollout speed: completion tokens per second of an RL stage's rollout (toolkit/evals/rollout.py) against TRL's
GRPOTrainer generation, on the same model, prompts, group size, completion length and sampling settings, as a
ratio measured in one run (interleaved repeats, the median of each).

    python bench/rollout.py                      # the built-in tiny Qwen3, CPU: prints one JSON object
    python bench/rollout.py --model PATH --prompts 16 --generations 8 --length 256 --repeats 5

TRL's side is its own `_generate` (transformers' `generate` with TRL's generation config, the whole generation batch
in one call, no vLLM), on a GRPOTrainer built offline around the same model; ours draws the same prompts in one
batch with per-completion seeded sampling. Both count the completion tokens they return (each up to its end token).
The tiny random model rarely ends early, so both generate about `length` tokens per completion. Needs the `bench`
extra (TRL). Timings belong to the machine: publish them with its load (`load_avg_1m`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a causal LM folder (default: the built-in tiny Qwen3)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from toolkit.builtin.dummy_data import write_dummy_letters
    from toolkit.builtin.models import TINY_MODEL, materialize_builtin
    from toolkit.evals.rollout import rollout

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    path = args.model or materialize_builtin(TINY_MODEL, work / "models")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = [json.loads(line) for line in write_dummy_letters(work, args.prompts).read_text().splitlines()]
    batch = args.prompts * args.generations
    config = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=batch,
                        num_generations=args.generations, max_completion_length=args.length, temperature=1.0,
                        top_p=1.0, use_cpu=not torch.cuda.is_available(), bf16=False, report_to=[],
                        gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=config, train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in rows]),
                          processing_class=tokenizer)
    trainer.model.eval()
    prompts = [r["prompt"] for r in rows for _ in range(args.generations)]  # TRL's sampler repeats each prompt
    ids = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
           for r in rows]

    def trl_run() -> int:
        _, completion_ids, *_ = trainer._generate(prompts)
        return sum(len(c) for c in completion_ids)

    def ours_run(step: int) -> int:
        out = rollout(trainer.model, ids, list(range(len(ids))), num_generations=args.generations,
                      max_completion_length=args.length, temperature=1.0, top_p=1.0, seed=0, step=step,
                      eos_ids=trainer.eos_token_ids, pad_id=tokenizer.pad_token_id, prompts_per_batch=len(ids))
        return sum(len(c) for c in out.completion_ids)

    rates: dict[str, list[float]] = {"ours": [], "trl": []}
    per_cpu_s: dict[str, list[float]] = {"ours": [], "trl": []}  # tokens per CPU second: steadier on a busy machine
    trl_run(), ours_run(0)  # warm-up
    for r in range(args.repeats):
        pair = [("ours", lambda r=r: ours_run(r + 1)), ("trl", trl_run)]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:  # alternate which goes first
            start, cpu = time.perf_counter(), time.process_time()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - start))
            per_cpu_s[name].append(tokens / (time.process_time() - cpu))
    ours, trl = statistics.median(rates["ours"]), statistics.median(rates["trl"])
    ours_cpu, trl_cpu = statistics.median(per_cpu_s["ours"]), statistics.median(per_cpu_s["trl"])
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename,
                      "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
                      "load_avg_1m": os.getloadavg()[0], "model": args.model or TINY_MODEL, "prompts": args.prompts,
                      "generations": args.generations, "length": args.length, "repeats": args.repeats,
                      "tokens_per_s": {"ours": round(ours, 1), "trl": round(trl, 1)},
                      "ratio_ours_over_trl": round(ours / trl, 3),
                      "tokens_per_cpu_s": {"ours": round(ours_cpu, 1), "trl": round(trl_cpu, 1)},
                      "cpu_ratio_ours_over_trl": round(ours_cpu / trl_cpu, 3), "runs": rates}))


if __name__ == "__main__":
    main()
