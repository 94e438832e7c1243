"""User-facing errors: one line that says what is wrong and how to fix it."""


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
