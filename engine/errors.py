"""User-facing errors: one line that says what is wrong and how to fix it."""


def one_line(text: str) -> str:
    """The text as one printable line: newlines, escapes and other control characters spelled out
    (a name holding a newline or a terminal escape is printed, not obeyed)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(text))


class BonsaiError(Exception):
    """An error caused by the user's input or environment (bad file, bad config, no network).

    The CLI prints the message as one line and exits 1; the server turns it into an OpenAI-style
    error object. Internal invariants use ``assert`` instead.
    """


class ModelFileError(BonsaiError):
    """A model file or directory is missing, corrupt or of a kind we do not support."""


class UnsupportedModelError(BonsaiError):
    """The model's architecture or one of its options is not supported."""


class ServiceUnavailable(BonsaiError):
    """The server cannot take the request now (shutting down, or its engine stopped): HTTP 503."""


class GroupSizeError(BonsaiError):
    """A matrix cannot be packed in groups of the size asked for; the message names the setting
    where that size came from (a CLI flag by default, `for_setting` names a config key instead)."""

    def __init__(self, problem: str, setting: str = "--group-size"):
        super().__init__(f"{problem}; choose another {setting}")
        self.problem = problem

    def for_setting(self, setting: str) -> "GroupSizeError":
        return GroupSizeError(self.problem, setting)


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (one-line errors and logs)."""
    return str(e).splitlines()[0] if str(e) else ""


def error_message(e: Exception) -> str:
    """What a request that failed on `e` is told: a BonsaiError's line, else the internal error named."""
    return first_line(e) if isinstance(e, BonsaiError) else f"internal error: {type(e).__name__}: {first_line(e)}"
