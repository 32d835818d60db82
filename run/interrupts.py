"""
How a script stops, in one place: Ctrl-C, SIGTERM (kill, schedulers), SIGHUP (the terminal closed),
an output whose reader went away (`| head`) and out of memory each end it with one line on stderr
and an exit code, never a traceback. Imports no torch, nor any module of ours: train.py installs its
handlers before its slow imports.

    Interrupts()                    train.py: at once during start-up, then a flag its loop checks
    exit_at_once()                  the other scripts, first: their slow imports stopped in one line
                                    (both: a closed stdout or stderr writes to /dev/null)
    exit_on_signals()               ... once imported: SIGTERM / SIGHUP as one line and a
                                    SystemExit (finally blocks still remove temp files)
    on_closed_output(gone)          gone(reason) once, when stdout or stderr loses its reader
                                    (None) or its disk fills (the reason in words); later output
                                    is dropped; end_on_lost_output: a gone() that ends a script
    memory_errors_in_one_line(...)  out of memory and Ctrl-C as one line (every script)
"""
import atexit
import errno
import os
import re
import signal
import sys
from contextlib import contextmanager

# the signals that stop a script (Windows has no SIGHUP)
SIGNALS = [getattr(signal, n) for n in ('SIGINT', 'SIGTERM', 'SIGHUP') if hasattr(signal, n)]
OUT_OF_MEMORY = r"out of memory|can't allocate memory"  # torch's words for it, on a CPU or a GPU


class Interrupts:
    """Ctrl-C, SIGTERM, SIGHUP and (through on_closed_output) an output lost. While nothing is
    written they stop the process at once, even in a slow build; once the run writes they only set
    .flag (raising inside a save could break a file), which train.py's loop checks at every
    iteration and between evaluation batches; .why says what stopped, .code the exit code: 130 for
    a signal or a reader gone, 1 for an output that cannot be written (a full disk)."""

    def __init__(self):
        null_for_closed_streams()
        self.flag, self.immediate, self.why, self.code = False, True, 'interrupted', 130
        # Run.discard, once there is a run: removes what it made, says what is left
        self.discard = lambda: "nothing was written"
        for signum in SIGNALS:
            signal.signal(signum, self)

    def __call__(self, signum=None, frame=None):
        self.flag = True
        if self.immediate:
            self.stop()

    def output_lost(self, reason):
        """on_closed_output's gone(): a reader gone is an interrupt; an output that cannot be
        written stops as one."""
        self.why = reason or self.why  # (None: the reader went away, an interrupt)
        self.code = 1 if reason else self.code  # an output that cannot be written: an error
        self()

    def stop(self):
        say(f"error: {self.why} before training started; {self.discard()}")
        os._exit(self.code)

    @contextmanager
    def deferred(self):
        """A start-up step that writes files (preparing data, W&B's init): an interrupt waits for
        its end."""
        self.immediate = False
        yield
        self.immediate = True
        if self.flag:
            self.stop()


def say(line):
    """One line on stderr from a signal handler: os.write, not print (the handler may run inside a
    print)."""
    try:
        os.write(2, f"{line}\n".encode())
    except OSError:
        pass


def handle(signals, handler):
    """handler for each of signals, but one ignored (a background job's SIGINT, nohup's SIGHUP) is
    kept ignored."""
    for signum in signals:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, handler)


def exit_at_once():
    """While a script only imports (nothing to clean up): Ctrl-C, SIGTERM and SIGHUP end it at once
    in one line, exit 128 + N. Python's KeyboardInterrupt raised inside torch's C++ import would
    abort it (pybind11's terminate)."""
    null_for_closed_streams()
    handle(SIGNALS, at_once)


def null_for_closed_streams():
    """A stdout or stderr closed at the start (`>&-`, `2>&-`: cron, a detached shell) is not an
    error: it writes to /dev/null, as if sent there. Its descriptor is taken now: else the next file
    opened gets it, and what is printed lands in that file."""
    for fd, name in ((1, 'stdout'), (2, 'stderr')):
        if getattr(sys, name) is None:
            null = os.open(os.devnull, os.O_WRONLY)  # the lowest free descriptor: maybe fd already
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, os.fdopen(fd, 'w'))


def at_once(signum, frame):
    name = signal.Signals(signum).name
    say("error: interrupted" if signum == signal.SIGINT else f"error: stopped by {name}")
    os._exit(128 + signum)


def exit_on_signals():
    """After exit_at_once's imports: SIGTERM and SIGHUP end the process with one line and a
    SystemExit (exit 128 + N), Ctrl-C is a KeyboardInterrupt again: finally and with blocks still
    remove temp files, end workers."""
    def stop(signum, frame):
        say(f"error: stopped by {signal.Signals(signum).name}")
        sys.exit(128 + signum)
    handle([signum for signum in SIGNALS if signum != signal.SIGINT], stop)
    if signal.getsignal(signal.SIGINT) is at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def on_closed_output(gone):
    """Call gone(reason) (once per stream) when stdout or stderr loses its reader (reason None) or
    cannot be written (a full disk, /dev/full: 'cannot write to stdout (No space left on
    device)'); later output is dropped."""
    null_for_closed_streams()  # (data/common.py's scripts call only this)
    sys.stdout, sys.stderr = Output(sys.stdout, gone, 'stdout'), Output(sys.stderr, gone, 'stderr')


def end_on_lost_output(why):
    """on_closed_output's gone() for a script whose output is its result: a reader gone (`| head`
    has what it wanted) ends it quietly, exit 0; an output that cannot be written, in one line,
    exit 1 (a SystemExit: with and finally blocks still clean up)."""
    if why:
        say(f"error: {why}")
    sys.exit(1 if why else 0)


class Output:
    """sys.stdout or sys.stderr whose reader may go away (`| head` closed the pipe, the terminal
    hung up) or whose file cannot grow (a full disk): the output then goes to /dev/null and gone()
    is called once, instead of an OSError at the next print."""

    def __init__(self, stream, gone, name):
        self.gone, self.name, self.closed_out, self.stream = gone, name, False, stream

    def write(self, text):
        return self.guard(self.stream.write, text) or len(text)

    def flush(self):
        self.guard(self.stream.flush)

    def guard(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            if self.closed_out:
                raise
            # the buffered bytes too: its file descriptor now writes to /dev/null
            self.closed_out = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            reader_gone = e.errno in (errno.EPIPE, errno.EIO)
            self.gone(None if reader_gone else f"cannot write to {self.name} ({e.strerror})")

    def __getattr__(self, name):
        return getattr(self.stream, name)


def memory_errors_in_one_line(sizes='batch_size, block_size, the model'):
    """Out of memory (a size too large for this machine) and Ctrl-C are one line on stderr, not a
    traceback; an out-of-memory exits 2, as every other bad input."""
    default = sys.excepthook

    def hook(kind, e, tb):
        if issubclass(kind, KeyboardInterrupt):
            print("error: interrupted", file=sys.stderr, flush=True)
            leave(130)
        if issubclass(kind, MemoryError) or re.search(OUT_OF_MEMORY, str(e)):
            # (configurator's describe, which imports torch, in short)
            what = f"{kind.__name__}: {' '.join(str(e).split())[:240]}"
            print(f"error: out of memory ({what}); try smaller sizes ({sizes})",
                  file=sys.stderr, flush=True)
            leave(2)
        else:
            default(kind, e, tb)
    sys.excepthook = hook


def leave(code):
    """Exit with code from an excepthook, after the atexit cleanups that os._exit alone skips (a new
    run's out_dir and lock, a pool's workers and semaphores, temp folders)."""
    try:
        atexit._run_exitfuncs()
    finally:
        os._exit(code)
