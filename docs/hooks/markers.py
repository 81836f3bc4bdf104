"""A page's generated parts: a line `<!-- KIND: NAME -->` replaced, when the site is built, by what a
hook builds for NAME (flow.py's state diagrams, models.py's model list). A name the hook does not
know fails the build, naming the page."""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["marker", "render_markers"]


def marker(kind: str) -> re.Pattern[str]:
    """The placeholder line of `kind`, its NAME captured."""
    return re.compile(rf"^<!--[ \t]*{re.escape(kind)}:[ \t]*([\w.-]+)[ \t]*-->[ \t]*$", re.MULTILINE)


def render_markers(pattern: re.Pattern[str], build: Callable[[str], str], markdown: str, where: str = "") -> str:
    """`markdown` with each placeholder of `pattern` replaced by `build(NAME)`; a KeyError from
    `build` (an unknown name) is re-raised naming `where`."""

    def sub(m: re.Match[str]) -> str:
        try:
            return "\n" + build(m.group(1)) + "\n"
        except KeyError as e:
            raise KeyError(f"{where}: {e}") from e

    return pattern.sub(sub, markdown)
