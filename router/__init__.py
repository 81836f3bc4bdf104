"""OpenAI-compatible HTTP router: API, tokenization, prefix index, routing policy. Never imports torch."""

try:  # the installed package's version; a plain checkout falls back to pyproject's
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    __version__ = _version("baton-serve")
except PackageNotFoundError:  # pragma: no cover - depends on how the tree is installed
    __version__ = "0.1.0"
