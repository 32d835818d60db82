"""The maths model.py switches between: softmax attention, the linear rules (ours and fla's), the cache."""
