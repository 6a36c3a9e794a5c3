"""The data layer: rows from the formats users bring, tokenised once per machine into a shared token store, and
served to the training loop as index arrays and batches.

  sources.py   sources and formats: a data entry resolved (files, folders, globs, hub ids, LLaMA-Factory registry
               entries, split, columns, tags), rows read in pieces, the peers' shapes mapped to messages
  encoding.py  rows to token ids and loss masks with the chat template, many rows per tokenizer call
  store.py     the token store: prepared once per machine on every core, memory-mapped read-only by every rank
  plan.py      packing and ordering: length policy, packing plan, difficulty, as index arrays over the stores
  batching.py  batches: the DataLoader over a stage's rows, whose samples per step are a pure function of the step
"""

from toolkit.data.encoding import (
    DataStats,
    EncodedBatch,
    TextEncoder,
    check_messages,
    encode_row,
    fit_to_length,
    has_generation_tags,
)
from toolkit.data.plan import EncodedRows, TrainingSet, encode_files, load_training_set
from toolkit.data.sources import Entry, content_digest, iter_jsonl, resolve_data_paths, resolve_source
from toolkit.labels import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "DataStats", "EncodedBatch", "EncodedRows", "Entry", "TextEncoder",
           "TrainingSet", "check_messages", "content_digest", "encode_files", "encode_row", "fit_to_length",
           "has_generation_tags", "iter_jsonl", "load_training_set", "resolve_data_paths", "resolve_source"]
