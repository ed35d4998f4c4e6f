"""Command-line helpers shared by the daemons' ``__main__`` modules."""

from __future__ import annotations

import argparse


def comma_list(choices: tuple[str, ...]):
    """An argparse type for ``a,b,c`` variant lists (ARCHITECTURE §6), each one of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)} (got {text!r})")
        return items

    return parse
