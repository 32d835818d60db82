"""bench.py's reports, one module each, and the timing they share with sample.py --compare."""
