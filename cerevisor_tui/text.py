"""How a string that came from outside (a client, a server, a file) is shown: one rule for every screen, headless
line and log line, so that what a harness or a server says is data and never a terminal's command."""

from __future__ import annotations

import unicodedata

_BREAKING = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def control_char(text: str) -> str | None:
    """The first character that would break a line or move the cursor (control, format, separator), if any."""
    if text.isprintable():  # (none of those is printable: a name checked on every request costs 0.1 us, not 2)
        return None
    return next((ch for ch in text if unicodedata.category(ch) in _BREAKING), None)


def printable(text: str) -> str:
    """`text` with each character a terminal would act on (ESC, BEL, CR, LF, a C1 control, a bidi override, a line
    separator...) written as its escape (`\\x1b`, `\\u202e`): it can set no title, clear no screen and forge no
    line. The same object when there was nothing to escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)
