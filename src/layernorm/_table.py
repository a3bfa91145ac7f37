"""One table renderer for every command: aligned plain text or Markdown."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["render"]


def render(
    head: Sequence[str], body: Sequence[Sequence[str]], markdown: bool = False, align: str = "<"
) -> str:
    """``head`` and ``body`` rows of strings as a table.

    Markdown escapes ``|`` inside cells; plain text pads columns (``align`` "<" or ">") and
    underlines the header.
    """
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
                                  for row in body])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{align}{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [head, ["-" * w for w in widths], *body])
