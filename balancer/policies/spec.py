"""Policy specs: ``name`` or ``name:param=value[,param=value...]``, the one text form of a policy.

Every place a user names a policy takes this form and parses it here: ``pdlb sim run --policy``
(and ``--prefill-policy`` / ``--decode-policy``), ``pdlb sim compare --policies``, ``pdlb sim
capacity --policy``, sweep files, ``pdlb serve --prefill-policy / --decode-policy`` and the
service config's ``prefill_policy`` / ``decode_policy`` (a spec string or a ``{name, params}``
table)::

    cache_aware                                   defaults
    cache_aware:cache_threshold=0.5,balance_abs=8 two parameters
    ep_aware:spread=false                          booleans: true/false, yes/no, 1/0

Values are typed by the parameter's default (``bool``, ``int``, ``float``, ``str``); a parameter
whose default is ``None`` takes the first of int, float, bool, ``none``, str that fits. A list of
specs (``--policies``) is comma-separated; a part of the form ``key=value`` continues the spec
before it, so ``cache_aware:cache_threshold=0.5,balance_abs=8,round_robin`` is two policies.

Errors are :class:`ValueError` with one line naming the bad part: an unknown policy (the closest
name, and the valid ones), an unknown parameter (the policy's accepted parameters with their
defaults), a value of the wrong type, a parameter given twice, an empty parameter (a stray comma:
``cache_aware:cache_threshold=0.5,``), or the policy's own check.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping

from balancer.policies.base import Policy, available_policies, make_policy, policy_class

__all__ = ["accepted_params", "build_policy", "format_policy_spec", "parse_param_value", "parse_policy_spec",
           "split_policy_list", "unknown_policy_message"]

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def unknown_policy_message(name: str) -> str:
    """``"unknown policy 'x' (did you mean 'y'?); valid policies: a, b, ..."``."""
    valid = available_policies()
    close = difflib.get_close_matches(name.replace("-", "_"), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown policy {name!r}{hint}; valid policies: {', '.join(valid)}"


def _policy_class(name: str) -> type[Policy]:
    try:
        return policy_class(name)
    except ValueError:
        raise ValueError(unknown_policy_message(name)) from None


def _defaults(cls: type[Policy]) -> dict[str, object]:
    if not dataclasses.is_dataclass(cls):
        return {}
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = dataclasses.MISSING
    return out


def accepted_params(name: str) -> str:
    """The parameters of policy ``name`` as ``"a=1, b=0.5"`` (default values), or ``"none"``.

    Raises:
        ValueError: unknown policy.
    """
    d = _defaults(_policy_class(name))
    return ", ".join(f"{k}={'(required)' if v is dataclasses.MISSING else v!r}" for k, v in sorted(d.items())) or "none"


def parse_param_value(text: str, default: object = None) -> object:
    """A policy parameter from text, typed by the parameter's default when it has one:
    ``bool`` from true/false/1/0/yes/no, ``int``, ``float``, ``str``; with no typed default
    (``None``) the first of int, float, bool, ``none`` (None), str that parses.

    Raises:
        ValueError: the text is not of the default's type (``"expected an integer, got 'x'"``).
    """
    t = text.strip()
    low = t.lower()
    if isinstance(default, bool):
        if low not in _BOOLS:
            raise ValueError(f"expected true or false, got {text!r}")
        return _BOOLS[low]
    if isinstance(default, int):
        try:
            return int(t)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if isinstance(default, float):
        try:
            return float(t)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if isinstance(default, str):
        return t
    if low == "none":
        return None
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return _BOOLS.get(low, t)


def parse_policy_spec(text: str) -> tuple[str, dict[str, object]]:
    """``"cache_aware:cache_threshold=0.5"`` -> ``("cache_aware", {"cache_threshold": 0.5})``,
    checked by building the policy once (so its own range checks run now).

    Raises:
        ValueError: see the module docstring; the message starts with ``policy '<name>'`` or
            ``unknown policy``.
    """
    if not isinstance(text, str):
        raise ValueError(f"a policy spec must be a string like 'cache_aware:cache_threshold=0.5', got {text!r}"[:200])
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"policy spec {text!r}: missing the policy name before ':'")
    cls = _policy_class(name)
    defaults = _defaults(cls)
    params: dict[str, object] = {}
    parts = [p.strip() for p in rest.split(",")] if rest.strip() else []
    if not all(parts):  # 'k=v,' or 'k=v,,k2=v2': a typo, refused as --policies refuses 'a,,b'
        raise ValueError(f"policy {name!r}: an empty parameter in {text.strip()!r} (a stray comma); write "
                         f"{name}:param=value[,param=value]; accepted: {accepted_params(name)}")
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"policy {name!r}: expected param=value, got {part!r}; accepted: {accepted_params(name)}")
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"policy {name!r} has no parameter {key!r}{hint}; accepted: {accepted_params(name)}")
        if key in params:
            raise ValueError(f"policy {name!r}: parameter {key!r} given more than once")
        default = defaults[key]
        try:
            params[key] = parse_param_value(value, None if default is dataclasses.MISSING else default)
        except ValueError as e:
            raise ValueError(f"policy {name!r}: {key}: {e}") from None
    check_policy_params(name, params)
    return name, params


def check_policy_params(name: str, params: Mapping[str, object]) -> Policy:
    """Build policy ``name`` with ``params`` (already typed), with the errors of this module.

    Raises:
        ValueError: unknown policy or parameter (accepted ones listed), or the policy's own check
            (``"policy 'x': <its message>"``).
    """
    cls = _policy_class(name)
    defaults = _defaults(cls)
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ValueError(f"policy {name!r} has no parameter(s) {', '.join(map(repr, unknown))}; "
                         f"accepted: {accepted_params(name)}")
    try:
        return make_policy(name, **params)
    except (ValueError, TypeError) as e:
        msg = str(e).removeprefix(f"{name}: ")  # policies prefix their own checks with their name
        raise ValueError(msg if msg.startswith(f"policy {name!r}") else f"policy {name!r}: {msg}") from None


def build_policy(text: str) -> Policy:
    """The policy object of a spec (:func:`parse_policy_spec`)."""
    name, params = parse_policy_spec(text)
    return make_policy(name, **params)


def format_policy_spec(name: str, params: Mapping[str, object] | None = None) -> str:
    """The label of a policy with parameters: ``cache_aware``, ``cache_aware(cache_threshold=0.5)``
    (parameters sorted by name; the form result tables and file names use)."""
    if not params:
        return name
    return f"{name}({','.join(f'{k}={params[k]}' for k in sorted(params))})"


def split_policy_list(text: str) -> list[str]:
    """``"a:x=1,y=2,b"`` -> ``["a:x=1,y=2", "b"]``: comma-separated specs, where a ``key=value``
    part (``=`` before any ``:``) continues the spec before it. Empty parts are dropped.

    Raises:
        ValueError: a ``key=value`` part that follows no ``name:...`` spec (``"a,x=1"``: write ``a:x=1``).
    """
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        eq, colon = part.find("="), part.find(":")
        if eq >= 0 and (colon < 0 or eq < colon):
            if not out or ":" not in out[-1]:
                before = f"{out[-1]!r} has no ':'" if out else "no policy comes before it"
                raise ValueError(f"policy parameter {part!r}: {before}; write name:{part}")
            out[-1] += "," + part
            continue
        out.append(part)
    return out
