"""The label value that carries no loss, shared by the data layer, packing, evaluation and the loop.

Its own module so that toolkit/data/ and toolkit/packing.py (which the data layer calls to pack rows) need not
import each other for it.
"""

IGNORE_INDEX = -100
"""Label of a token that carries no loss (the value transformers' losses ignore)."""
