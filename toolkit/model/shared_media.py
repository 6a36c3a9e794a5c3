"""Images shown more than once in a batch, encoded once: a preference pair's two sides show their prompt's images.

The pair collator passes each distinct image's pixels once (`toolkit.data.collate.SHARED_IMAGES`: for every
occurrence in `image_grid_thw`, which distinct image it shows). Qwen2.5-VL / Qwen3-VL's forward hands `pixel_values`
and `image_grid_thw` to the vision tower (`model.visual`) and scatters the tower's merged embeddings over the
`<|image_pad|>` tokens in order, so the forward needs one embedding block per occurrence. `shared_images` wraps the
model's forward with two hooks on the tower: before it, the grids of the distinct images only (the pixels' own);
after it, each occurrence's block gathered from its image's (the merged embeddings and, for Qwen3-VL, every
deepstack level's).

Why this way, and why it is exact: both sides of a pair see the very same embeddings of their images, those a run
of the tower on the pixels gives (bitwise those of a side scored alone with its images, on CPU:
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


@contextlib.contextmanager
def shared_images(model: torch.nn.Module, plan: list[list[int]] | None) -> Iterator[None]:
    """The model's forward within this block gives each image occurrence of `plan` (the batch's `SHARED_IMAGES`:
    per occurrence in text order, `[its distinct image, t, h, w]`) the embeddings of its distinct image (the module
    docstring); with no `plan`, nothing changes. The first call of the tower within the block is the images'
    (Qwen's forward encodes images before videos); a call whose inputs are not the distinct images' is refused."""
    if plan is None:
        yield
        return
    tower = vision_tower(model)
    merge = int(tower.spatial_merge_size) ** 2
    owner = [int(p[0]) for p in plan]
    first: dict[int, int] = {}
    for n, u in enumerate(owner):
        first.setdefault(u, n)
    if sorted(first) != list(range(len(first))):
        raise ValueError("shared image owners must number the distinct images 0..k-1")
    distinct = torch.tensor([plan[first[u]][1:] for u in range(len(first))], dtype=torch.long)
    patches = int(distinct.prod(-1).sum())
    tokens = (distinct.prod(-1) // merge).tolist()
    starts = [sum(tokens[:u]) for u in range(len(tokens))]
    index = torch.cat([torch.arange(starts[u], starts[u] + tokens[u]) for u in owner])
    state = {"calls": 0}

    def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state["calls"] += 1
        if state["calls"] > 1:
            return None
        pixels = args[0] if args else kwargs["hidden_states"]
        given = kwargs.get("grid_thw")
        if given is None or len(given) != len(owner) or pixels.shape[0] != patches:
            raise ValueError("the vision tower's first call is not the shared images' (pixels of the distinct "
                             "images, a grid per occurrence)")
        return args, {**kwargs, "grid_thw": distinct.to(given.device, non_blocking=True)}

    def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if state["calls"] > 1:
            return None
        at = index.to(output.pooler_output.device, non_blocking=True)
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
