"""
Tiny Shakespeare at the character level (nanoGPT's shakespeare_char): 65 symbols, uint16 ids.

    python data/shakespeare_char/prepare.py                 # downloads input.txt
    python data/shakespeare_char/prepare.py --input PATH    # or SHAKESPEARE_PATH=PATH: a local copy
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from run.interrupts import exit_on_signals, memory_errors_in_one_line  # noqa: E402

if __name__ == '__main__':  # first: Ctrl-C or a kill during the slow imports below is one line too
    memory_errors_in_one_line()
    exit_on_signals()  # (a kill mid-write leaves no temp file)
from data.common import read_text, split, save, cli  # noqa: E402


def prepare(out_dir, input_path=None):
    text = read_text(input_path, download_to=os.path.join(out_dir, 'input.txt'))
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    train, val = split(text)
    save(out_dir, [stoi[c] for c in train], [stoi[c] for c in val],
         {'kind': 'char', 'vocab_size': len(chars), 'itos': chars})


if __name__ == '__main__':
    cli(prepare, __doc__)
