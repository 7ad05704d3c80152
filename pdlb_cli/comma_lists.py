"""The items of list-valued options (``--pdlb-processes 1,8``, ``--rates 1,2,4``), one parser for
every ``pdlb`` command and the bench/ scripts, so that a malformed list is refused the same way
everywhere, with a message that says what is expected: no item, an empty item (``1,,2``), an item
given twice where the list is a set. Standard library only (the bench scripts import it without
the simulator).
"""

from __future__ import annotations

import argparse
import difflib
import typing
from typing import Any


#: most items a list-valued option takes (the duplicate checks then cost at most this squared)
MAX_ITEMS = 4096


class CommaListError(ValueError, argparse.ArgumentTypeError):
    """A malformed comma list: a ``ValueError`` for the callers that check values after parsing,
    and an ``ArgumentTypeError`` so that argparse shows its message as ``argument --flag: ...``
    (argparse words a plain ``ValueError`` from a ``type=`` as ``invalid <type> value``)."""


def comma_items(text: str, what: str, *, flag: str | None = None, distinct: bool = True) -> list[str]:
    """The items of a list-valued option (``"1, 8"`` -> ``["1", "8"]``), for every ``pdlb`` command
    and the bench/ scripts: spaces around an item are dropped; refused with a message that says
    what is expected (``what``, e.g. ``"integers >= 1"``; prefixed ``"<flag>: "`` when given):
    no item at all; an empty item (``1,,2``, a leading or trailing comma: a typo, not a shorter
    list); with ``distinct`` (lists that are sets: counts, names, modes, keys) an item given twice
    (a ramp of rates, a sequence, passes ``distinct=False``); more than :data:`MAX_ITEMS` items.
    The items' own values are the caller's to check (negative counts, unknown names).

    Raises:
        CommaListError: as above (a ``ValueError`` and an ``argparse.ArgumentTypeError``).
    """
    head = f"{flag}: " if flag else ""
    parts = text.split(",")
    if not text.strip():
        raise CommaListError(f"{head}expected {what} separated by commas, got nothing")
    if len(parts) > MAX_ITEMS:
        raise CommaListError(f"{head}expected at most {MAX_ITEMS:,} {what}, got {len(parts):,} items")
    items = [p.strip() for p in parts]
    for i, item in enumerate(items):
        if not item:
            where = "a leading comma" if i == 0 else "a trailing comma" if i == len(parts) - 1 else \
                f"two commas in a row after {','.join(parts[:i])!r}"
            raise CommaListError(f"{head}expected {what} separated by single commas, got {text!r} "
                                 f"(item {i + 1} is empty: {where})")
    if distinct:
        seen = set()
        for item in items:
            if item in seen:
                raise CommaListError(f"{head}expected distinct {what}, got {text!r} ({item!r} is given twice)")
            seen.add(item)
    return items


def comma_list(text: str, item: typing.Callable[[str], Any], what: str, *, flag: str | None = None,
               distinct: bool = True) -> list[Any]:
    """:func:`comma_items`, each item converted by ``item`` (a ``type=`` function such as
    :func:`pdlb_cli.args.positive_int`); an item it refuses (``ValueError`` or
    ``ArgumentTypeError``) gets its message (which should say what is expected), the item's
    position and the list. Duplicates are told by the converted values too (``1,01``).

    Raises:
        CommaListError: a malformed list (:func:`comma_items`) or an item ``item`` refuses.
    """
    head = f"{flag}: " if flag else ""
    out: list[Any] = []
    for i, text_item in enumerate(comma_items(text, what, flag=flag, distinct=distinct)):
        try:
            value = item(text_item)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise CommaListError(f"{head}{e} (item {i + 1} of {text!r})") from None
        if distinct and value in out:
            raise CommaListError(f"{head}expected distinct {what}, got {text!r} ({text_item!r} is given twice)")
        out.append(value)
    return out


def one_of(choices: typing.Iterable[str]) -> typing.Callable[[str], str]:
    """An item converter for :func:`comma_list`: the item itself if it is one of ``choices``."""
    valid = tuple(choices)

    def check(text: str) -> str:
        if text not in valid:
            close = difflib.get_close_matches(text, valid, n=1, cutoff=0.75)
            raise ValueError(f"unknown {text!r}" + (f", did you mean {close[0]!r}?" if close else "")
                             + f"; valid: {', '.join(valid)}")
        return text
    return check


def list_arg(ap: argparse.ArgumentParser, flag: str, text: str, what: str, item: typing.Callable[[str], Any] = str,
             *, distinct: bool = True, empty_ok: bool = False) -> list[Any]:
    """:func:`comma_list` for a value already parsed as a string (the bench/ scripts): a bad list
    stops ``ap`` with ``<flag>: <message>`` (``ap.error``, exit status 2); ``empty_ok``: an empty
    value is the empty list."""
    if empty_ok and not text.strip():
        return []
    try:
        return comma_list(text, item, what, distinct=distinct)
    except CommaListError as e:
        ap.error(f"{flag}: {e}")
