"""The data layer: rows from the formats users bring, tokenised once per machine into a shared token store, and
served to the training loop as index arrays and batches.

  sources.py   sources and formats: a data entry resolved (files, folders, globs, hub ids, LLaMA-Factory registry
               entries, split, columns, tags), rows read in pieces, the peers' shapes mapped to messages
  encoding.py  rows to token ids and loss masks with the chat template, many rows per tokenizer call
  store.py     the token store: prepared once per machine on every core, memory-mapped read-only by every rank
  plan.py      packing and ordering: length policy, packing plan, difficulty, as index arrays over the stores
  batching.py  batches: the DataLoader over a stage's rows, whose samples per step are a pure function of the step
  packing.py   packed rows split back into samples, and their varlen boundaries for the attention kernels
  collate.py   micro-batches: padded or packed, text or image rows
  vision.py    image-text rows: images decoded and expanded into the processor's image tokens
  stages.py    a run's data: each stage's sources, token stores, fingerprint and training / eval rows
"""
