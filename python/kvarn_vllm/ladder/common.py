"""What every part of the ladder shares: the program's name, the
reference's, and the usage error (exit status 2)."""

PROG = "kvarn-vllm-ladder"
REFERENCE = "auto"


class UsageError(Exception):
    """A bad option, model, text or format: reported with exit status 2.
    .short: the reason alone, without the list of what is accepted (the
    "refused" rows of `all`)."""

    def __init__(self, msg: str, short: str = ""):
        super().__init__(msg)
        self.short = short or msg


