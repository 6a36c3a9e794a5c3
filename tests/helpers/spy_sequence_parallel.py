"""`train_curriculum.py` with a spy on what reaches the kernels under Ulysses sequence parallelism.

Launched in place of train_curriculum.py (`accelerate launch tests/helpers/spy_sequence_parallel.py --config ...`,
with SPY_SP_DIR set). Per training micro-batch it records, in order: the row length T the loop sliced
(`shard_batch`, after padding to a multiple of sp_size), the tokens each decoder layer received, and for each
attention kernel call the heads of the query and of the key/value, the tokens it attended over, whether a mask came
with it, and the last packed-row boundary (`cu_seq_lens_q[-1]`) it was handed. One JSON per rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import train_curriculum
from toolkit.runtime import process as distributed
from toolkit.strategies import sequence_parallel

events: list[list[Any]] = []
_shard = sequence_parallel.shard_batch


def _spied_shard(batch: dict[str, Any], place: sequence_parallel.Layout, **kwargs: Any) -> Any:
    out = _shard(batch, place, **kwargs)
    events.append(["row", out[0]["input_ids"].shape[1] * place.sp_size, int(out[0]["input_ids"].shape[0])])
    return out


def _layer_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    if module.training:
        hidden = args[0] if args else kwargs["hidden_states"]
        events.append(["layer", int(hidden.shape[1])])


_prepare = train_curriculum.prepare


def _spied_prepare(accelerator: Any, model: torch.nn.Module, optimizer: Any) -> Any:
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            module.register_forward_pre_hook(_layer_hook, with_kwargs=True)
    model, optimizer = _prepare(accelerator, model, optimizer)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    kernel = accelerator.unwrap_model(model).config._attn_implementation
    ulysses = ALL_ATTENTION_FUNCTIONS[kernel].ulysses  # toolkit.strategies.sequence_parallel.follow_batch_size's
    core = ulysses.attn

    def spied_core(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        if module.training:
            cu = kwargs.get("cu_seq_lens_q")
            events.append(["attention", int(query.shape[1]), int(key.shape[1]), int(query.shape[2]),
                           attention_mask is None, int(cu[-1]) if cu is not None else None,
                           isinstance(kwargs.get("max_length_q"), int) if cu is not None else None])
        return core(module, query, key, value, attention_mask, *args, **kwargs)

    ulysses.attn = spied_core
    return model, optimizer


sequence_parallel.shard_batch = _spied_shard
train_curriculum.prepare = _spied_prepare

if __name__ == "__main__":
    code = train_curriculum.main(sys.argv[1:])
    out = Path(os.environ["SPY_SP_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(events))
    distributed.exit_without_teardown(code)
