"""Built-in models and data that need no download: the tiny Qwen3 / Qwen2.5-VL / Qwen3-VL (`builtin:NAME`), and
the dummy chat data (`dummy:NAME`) for smoke runs anywhere."""
