"""Media shown more than once in a batch, encoded once: a preference pair's two sides show their prompt's images and
videos.

The pair collator passes each distinct image's pixels once, and each distinct video's frames once
(`toolkit.data.collate.SHARED_IMAGES` / `SHARED_VIDEOS`: for every occurrence in `image_grid_thw` / `video_grid_thw`,
which distinct medium it shows). Qwen2.5-VL / Qwen3-VL's forward hands `pixel_values` and `image_grid_thw`, then
`pixel_values_videos` and `video_grid_thw`, to the vision tower (`model.visual`, one call each) and scatters the
tower's merged embeddings over the `<|image_pad|>` / `<|video_pad|>` tokens in order, so the forward needs one
embedding block per occurrence. `shared_media` wraps the model's forward with two hooks on the tower: before a
planned call, the grids of the distinct media only (the pixels' own); after it, each occurrence's block gathered
from its medium's (the merged embeddings and, for Qwen3-VL, every deepstack level's). The rotary ids are untouched:
they read every occurrence's grid (and, for Qwen2.5-VL's videos, `second_per_grid_ts`) from the batch.

Why this way, and why it is exact: both sides of a pair see the very same embeddings of their media, those a run
of the tower on the pixels gives (bitwise those of a side scored alone with its media, on CPU:
tests/model/test_shared_media.py), and the gradient reaching the tower is the sum over the occurrences (the
gather's backward adds), as two runs' would be. The alternative, the model's `mm_encoder_outputs`
computed outside its forward, would call the tower outside the DDP / DeepSpeed / FSDP wrapper, whose hooks must see
every forward; the hooks here live inside the wrapped forward. The tower runs once per pair instead of twice.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from toolkit.errors import ToolkitError

_TOWERS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The model's vision tower (the module named `visual` with a `spatial_merge_size`), under any wrapper; found
    once per model."""
    if model in _TOWERS:
        return _TOWERS[model]
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "visual" and hasattr(module, "spatial_merge_size"):
            _TOWERS[model] = module
            return module
    raise ToolkitError("the batch shares its images between sequences (a vision pair's sides) but the model has no "
                       "vision tower ('visual'); vision pairs train on Qwen2.5-VL / Qwen3-VL.")


def _gather(plan: list[list[int]], merge: int) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """(the distinct media's grids, their patch count, each occurrence's merged-embedding rows in the tower's output
    over the distinct media, the occurrence count) of a plan: per occurrence in text order `[its distinct medium,
    t, h, w]`."""
    owner = [int(p[0]) for p in plan]
    first: dict[int, int] = {}
    for n, u in enumerate(owner):
        first.setdefault(u, n)
    if sorted(first) != list(range(len(first))):
        raise ValueError("shared media owners must number the distinct media 0..k-1")
    distinct = torch.tensor([plan[first[u]][1:] for u in range(len(first))], dtype=torch.long)
    tokens = (distinct.prod(-1) // merge).tolist()
    starts = [sum(tokens[:u]) for u in range(len(tokens))]
    index = torch.cat([torch.arange(starts[u], starts[u] + tokens[u]) for u in owner])
    return distinct, int(distinct.prod(-1).sum()), index, len(owner)


@contextlib.contextmanager
def shared_media(model: torch.nn.Module, calls: list[list[list[int]] | None]) -> Iterator[None]:
    """The model's forward within this block gives each medium occurrence the embeddings of its distinct medium
    (the module docstring). `calls` are the vision tower's calls within the forward, in order (Qwen's forward
    encodes the batch's images, then its videos): for each, the batch's plan (`SHARED_IMAGES` / `SHARED_VIDEOS`:
    per occurrence in text order, `[its distinct medium, t, h, w]`), or None for a call left as it is. With no plan
    at all, nothing changes. A planned call whose inputs are not the distinct media's is refused; a call past
    `calls` is left alone."""
    if all(plan is None for plan in calls):
        yield
        return
    tower = vision_tower(model)
    merge = int(tower.spatial_merge_size) ** 2
    gathers = [None if plan is None else _gather(plan, merge) for plan in calls]
    state = {"calls": 0}

    def planned() -> tuple[torch.Tensor, int, torch.Tensor, int] | None:
        n = state["calls"] - 1
        return gathers[n] if n < len(gathers) else None

    def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state["calls"] += 1
        gather = planned()
        if gather is None:
            return None
        distinct, patches, _, occurrences = gather
        pixels = args[0] if args else kwargs["hidden_states"]
        given = kwargs.get("grid_thw")
        if given is None or len(given) != occurrences or pixels.shape[0] != patches:
            raise ValueError(f"the vision tower's call {state['calls']} is not the shared media's (pixels of the "
                             "distinct media, a grid per occurrence)")
        return args, {**kwargs, "grid_thw": distinct.to(given.device, non_blocking=True)}

    def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        gather = planned()
        if gather is None:
            return None
        at = gather[2].to(output.pooler_output.device, non_blocking=True)
        output.pooler_output = output.pooler_output.index_select(0, at)
        if getattr(output, "deepstack_features", None) is not None:  # Qwen3-VL: one block per level
            output.deepstack_features = [f.index_select(0, at) for f in output.deepstack_features]
        return output

    handles = [tower.register_forward_pre_hook(before, with_kwargs=True),
               tower.register_forward_hook(after, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
