"""
Tiny Shakespeare with GPT-2's BPE (tiktoken 'gpt2'), as nanoGPT's shakespeare dataset.

    python data/shakespeare/prepare.py               # downloads input.txt (and tiktoken's gpt2)
    python data/shakespeare/prepare.py --input PATH  # or SHAKESPEARE_PATH=PATH: a local copy
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from run.interrupts import exit_on_signals, memory_errors_in_one_line  # noqa: E402

if __name__ == '__main__':  # first: Ctrl-C or a kill during the slow imports below is one line too
    memory_errors_in_one_line()
    exit_on_signals()  # (a kill mid-write leaves no temp file)
from data.common import PrepareError, read_text, split, save, cli  # noqa: E402


def prepare(out_dir, input_path=None, enc=None):
    """enc: a tiktoken.Encoding; default GPT-2's, which tiktoken downloads once (tests pass
    their own)."""
    text = read_text(input_path, download_to=os.path.join(out_dir, 'input.txt'))
    if enc is None:
        import tiktoken  # lazy: as in data/common.py
        try:
            enc = tiktoken.get_encoding('gpt2')
        except Exception as e:  # tiktoken raises plain exceptions when its download fails
            raise PrepareError(f"could not load tiktoken's 'gpt2' encoding ({type(e).__name__}); "
                               "it is downloaded on first use: run once with a network, or set "
                               "TIKTOKEN_CACHE_DIR to a cached copy") from None
    train, val = split(text)
    save(out_dir, enc.encode_ordinary(train), enc.encode_ordinary(val),
         {'kind': 'tiktoken', 'encoding': enc.name, 'vocab_size': enc.n_vocab})


if __name__ == '__main__':
    cli(prepare, __doc__)
