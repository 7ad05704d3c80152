"""One-line messages for pydantic validation errors (config files, CLI-built configs).

pydantic's own ``str(ValidationError)`` is a multi-line dump with a documentation URL; users of
``pdlb sim`` and ``pdlb serve`` get one line per problem instead::

    my.toml: prefill.num_engine: unknown field (valid: num_engines, dp_ranks, ...)
"""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ValidationError


def _model_in(ann: object) -> type[BaseModel] | None:
    """The pydantic model an annotation holds: ``M``, ``M | None``, ``list[M]``, ``dict[str, M]``."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for a in getattr(ann, "__args__", ()):
        m = _model_in(a)
        if m is not None:
            return m
    return None


def _valid_fields(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """The field names accepted at ``loc`` (a pydantic error location) in ``model``, if known.
    List indexes in ``loc`` (``speculative.acceptance_classes.0.x``) stay on the item's model."""
    cls = model
    for part in loc[:-1]:
        if cls is None:
            return []
        if isinstance(part, int):  # an item of a list of tables
            continue
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        cls = _model_in(field.annotation)
    return sorted(cls.model_fields) if cls is not None else []


def format_validation_error(err: ValidationError, source: str | None = None,
                            model: type[BaseModel] | None = None) -> str:
    """``err`` as ``"<source>: <field.path>: <message>"``, problems joined by ``"; "``.

    Unknown fields name the closest valid one ("did you mean") when ``model`` is given.
    """
    parts = []
    for e in err.errors():
        loc = tuple(e.get("loc", ()))
        where = ".".join(str(p) for p in loc)
        msg = e.get("msg", "invalid")
        if e.get("type") == "extra_forbidden":
            valid = _valid_fields(model, loc)
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1) if valid else []
            msg = "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
            if valid and not close:
                msg += f" (valid: {', '.join(valid)})"
        elif e.get("type") == "finite_number":  # NaN or an infinity (pydantic: "Input should be a finite number")
            msg = f"must be a finite number, got {e.get('input')!r}"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        # model-level checks have no field; a nested model's check that names its own path
        # ("speculative.acceptance: ...") is not prefixed again ("speculative: speculative.acceptance: ...")
        parts.append(f"{where}: {msg}" if where and not msg.startswith((f"{where}.", f"{where}:", f"{where}[")) else msg)
    text = "; ".join(parts)
    return f"{source}: {text}" if source else text


def syntax_error_line(source: str, err: Exception) -> str:
    """A YAML, TOML or JSON syntax error as one line, ``"<source>:<line>:<column>: <message>"``
    (1-based, as editors and compilers print it; ``"<source>: <message>"`` where the parser gave
    no position). PyYAML's multi-line "while parsing ... in <unicode string>, line 3, column 3"
    dump becomes ``"f.yaml:4:1: expected ',' or '}', but got '<stream end>' (in a flow mapping
    opened at line 3, column 3)"``.
    """
    import json
    import re

    mark = getattr(err, "problem_mark", None)
    if mark is not None:  # yaml.MarkedYAMLError
        problem = getattr(err, "problem", None) or "invalid YAML"
        context, cmark = getattr(err, "context", None), getattr(err, "context_mark", None)
        where = ""
        if context and cmark is not None and (cmark.line, cmark.column) != (mark.line, mark.column):
            what = context.removeprefix("while parsing ").removeprefix("while scanning ")
            where = f" (in {what} opened at line {cmark.line + 1}, column {cmark.column + 1})"
        elif context:
            where = f" ({context})"
        return f"{source}:{mark.line + 1}:{mark.column + 1}: {problem}{where}"
    if isinstance(err, json.JSONDecodeError):
        return f"{source}:{err.lineno}:{err.colno}: {err.msg}"
    text = " ".join(str(err).split())
    m = re.search(r"\s*\(at line (\d+), column (\d+)\)$", text)  # tomllib's message
    if m:
        return f"{source}:{m.group(1)}:{m.group(2)}: {text[:m.start()]}"
    m = re.search(r"\s*\(at end of document\)$", text)
    if m:
        return f"{source}: {text[:m.start()]} (at the end of the file)"
    return f"{source}: {text}"
