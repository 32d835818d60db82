"""The maths model.py switches between: softmax attention, MLA's two ways to attend, the linear
rules (ours and fla's), the cache, and sampling a token."""
