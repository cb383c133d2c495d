"""The ladder's progress line on stderr."""
import sys

from .common import PROG


class Progress:
    """The progress line on stderr: rewritten in place on a terminal, one
    line per event otherwise."""

    def __init__(self, n_formats: int, n_windows: int):
        self.nf, self.nw = n_formats, n_windows
        self.tty = sys.stderr.isatty()
        self.open = False

    def show(self, i: int, label: str, what: str) -> None:
        line = f"{PROG}: [{i}/{self.nf}] {label}: {what}"
        if self.tty:
            sys.stderr.write("\r\x1b[K" + line)
            self.open = True
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        if self.open:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.open = False
