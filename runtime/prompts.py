"""One check of the prompts a request decodes, made before any work, shared by the commands and the Python API.

``rolecall decode`` and ``rolecall eval`` check their tokenized prompts with :func:`check_prompts`, as do
``Session.generate`` (:mod:`rolecall.runtime.session`), :func:`rolecall.runtime.engine.generate` and
:func:`rolecall.eval.evaluate_many`: a bad input is refused in one line (a ``ValueError``) that names the value,
the limit and the fix, never passed on to fail inside the model as a torch error, or to give a wrong result.

What is checked:

* the prompts: a 2-D integer tensor ``[batch, tokens]``, or a list (tuple) of prompts, each a list (tuple) of
  ints or a 1-D integer tensor. Refused: a 1-D tensor or a bare list of ints (one prompt without its batch:
  wrap it), text or bytes, a float or bool tensor, an id that is not an int (``2.5``, ``True``);
* every prompt has at least one token (with an attention mask: at least one the mask keeps);
* every id in ``[0, vocab_size)`` (:func:`rolecall.core.tokens.check_token_ids`), padding included (an embedding lookup
  reads it too);
* ``attention_mask``: the shape of the ids (per prompt as many values as tokens), 0s and 1s only;
* ``max_new_tokens``: a whole number ≥ 1 (not ``True``, not ``2.5``, not 0), or one per prompt where the caller
  takes that (:func:`check_max_new_tokens`);
* the longest prompt plus ``max_new_tokens`` within the model's context (:func:`rolecall.core.models.check_context`),
  unless the caller opted into a longer one: ``--allow-long-context`` in the commands,
  ``attach(..., allow_long_context=True)`` and ``evaluate(..., allow_long_context=True)`` in the Python API.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

API_OPT_IN = "allow_long_context=True"  # how the Python API asks for more than the model's context


class PromptError(ValueError):
    """Prompts of the wrong kind or shape (the message names the value, what is expected and the fix)."""


def check_max_new_tokens(value: Any, name: str = "max_new_tokens", least: int = 1, why: str = "") -> int:
    """``value`` as an int, or a one-line :class:`PromptError`: a whole number ≥ ``least`` (``why``: the reason
    for a ``least`` above 1), not a bool (``True`` is no count) nor a float (``2.5`` tokens cannot be made)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        example = max(least, 64)
        if name.isidentifier() or name.startswith("-"):  # a keyword, or a flag
            example = f"{name}{' ' if name.startswith('-') else '='}{example}"
        raise PromptError(f"{name} must be a whole number of tokens ≥ {least}{why}, got {value!r} "
                          f"({type(value).__name__}); pass an int, e.g. {example}")
    if value < least:
        raise PromptError(f"{name} must be a whole number of tokens ≥ {least}{why}, got {value}; generate at "
                          f"least {least} token{'s' if least > 1 else ''}")
    return int(value)


def _integer_tensor(t: torch.Tensor, what: str) -> None:
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise PromptError(f"{what} is a {t.dtype} tensor, but token ids are integers; pass a torch.long tensor "
                          "(what a tokenizer gives with return_tensors='pt')")


def _row(row: Any, what: str) -> list[int]:
    """One prompt as a list of ints, or a :class:`PromptError` naming it."""
    if isinstance(row, torch.Tensor):
        _integer_tensor(row, what)
        if row.dim() != 1:
            raise PromptError(f"{what} is a {row.dim()}-D tensor of shape {tuple(row.shape)}; a prompt is one "
                              "row of token ids (a 1-D tensor or a list of ints)")
        return row.tolist()
    if isinstance(row, (str, bytes, bytearray)):
        raise PromptError(f"{what} is {type(row).__name__}, not token ids; tokenize the text first "
                          "(tokenizer(text)['input_ids'])")
    if not isinstance(row, (list, tuple)):
        raise PromptError(f"{what} is of type {type(row).__name__}, not a prompt; a prompt is a list of token ids "
                          "(ints) or a 1-D integer tensor")
    if all(type(t) is int for t in row):  # the common case, without the slower checks below
        return list(row)
    for i, t in enumerate(row):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise PromptError(f"{what} holds {t!r} ({type(t).__name__}) at position {i}, but token ids are "
                              "integers; pass ints")
    return [int(t) for t in row]


def _rows(prompts: Any, name: str, row_names: Sequence[str] | None) -> list[list[int]]:
    """The prompts as lists of ints (a tensor's rows, or the rows of a list), or a :class:`PromptError`."""
    if type(prompts).__module__ == "numpy":  # a numpy array: as the tensor it converts to
        prompts = torch.as_tensor(prompts)
    if isinstance(prompts, (str, bytes, bytearray)):
        raise PromptError(f"{name} is {type(prompts).__name__}, not token ids; tokenize the text first "
                          "(tokenizer(text, return_tensors='pt')['input_ids'])")
    if isinstance(prompts, torch.Tensor):
        _integer_tensor(prompts, name)
        if prompts.dim() == 1:
            raise PromptError(f"{name} is a 1-D tensor of shape {tuple(prompts.shape)}: one prompt without its "
                              f"batch dimension; pass {name}[None] (shape [1, {prompts.shape[0]}]) or a list of "
                              "prompts")
        if prompts.dim() != 2:
            raise PromptError(f"{name} is a {prompts.dim()}-D tensor of shape {tuple(prompts.shape)}; pass a "
                              "[batch, tokens] tensor of token ids or a list of prompts")
        rows = prompts.tolist()
        if not rows:
            raise PromptError(f"{name} holds no prompt (shape {tuple(prompts.shape)}); pass at least one")
        return rows
    if not isinstance(prompts, (list, tuple)):
        raise PromptError(f"{name} is of type {type(prompts).__name__}; pass a [batch, tokens] integer tensor or a "
                          "list of prompts (lists of token ids)")
    if not prompts:
        raise PromptError(f"{name} holds no prompt; pass at least one")
    first = prompts[0]
    if isinstance(first, numbers.Number) or (isinstance(first, torch.Tensor) and first.dim() == 0):
        raise PromptError(f"{name} is a list of numbers: one prompt without its batch dimension; pass a list of "
                          f"prompts, [{name}], or a [1, {len(prompts)}] tensor")
    return [_row(row, _name(i, name, row_names)) for i, row in enumerate(prompts)]


def _name(i: int, name: str, row_names: Sequence[str] | None) -> str:
    return row_names[i] if row_names is not None else f"prompt {i + 1} of {name}"


def _kept(rows: list[list[int]], mask: Any, ids: Any, name: str) -> list[list[int]]:
    """Each row without the ids ``mask`` drops (0), after checking the mask's shape and values."""
    if isinstance(ids, torch.Tensor):
        if not isinstance(mask, torch.Tensor):
            raise PromptError(f"attention_mask is of type {type(mask).__name__}; pass a tensor of {name}'s shape "
                              f"{tuple(ids.shape)} (1 on a token, 0 on padding)")
        if tuple(mask.shape) != tuple(ids.shape):
            raise PromptError(f"attention_mask has shape {tuple(mask.shape)} but {name} has shape "
                              f"{tuple(ids.shape)}; pass one mask value per token (1 on a token, 0 on padding)")
        if bool(((mask == 0) | (mask == 1)).all()):  # the common case: no value to look for below
            return [[t for t, m in zip(row, mrow) if m] for row, mrow in zip(rows, mask.tolist())]
        values = mask.tolist()
    else:
        values = mask.tolist() if isinstance(mask, torch.Tensor) else mask
        lengths = [len(r) for r in rows]
        given = [len(r) for r in values] if isinstance(values, (list, tuple)) and all(
            isinstance(r, (list, tuple)) for r in values) else None
        if given != lengths:
            raise PromptError(f"attention_mask gives {given if given is not None else type(mask).__name__} values "
                              f"per prompt but the prompts of {name} have {lengths} tokens; pass one mask value per "
                              "token (1 on a token, 0 on padding)")
    for r, mrow in enumerate(values):
        bad = next((v for v in mrow if v not in (0, 1)), None)
        if bad is not None:
            raise PromptError(f"attention_mask row {r + 1} holds {bad!r}; a mask takes 1 on a token and 0 on "
                              "padding")
    return [[t for t, m in zip(row, mrow) if m] for row, mrow in zip(rows, values)]


def check_prompts(prompts: Any, *, vocab_size: int | None, max_new_tokens: int | Sequence[int],
                  attention_mask: Any = None, context: int | None = None, allow_long: bool = False,
                  warn_as: str | None = None, opt_in: str | None = API_OPT_IN, name: str = "input_ids",
                  new_name: str = "max_new_tokens", row_names: Sequence[str] | None = None,
                  per_row: bool = False, least: int = 1, why: str = "", fix: str | None = None,
                  limit_name: str = "the model's context of {limit} (max_position_embeddings)") -> list[list[int]]:
    """The prompts checked (see the module's docstring) and returned as lists of ints, the ids the attention
    mask drops left out; else a one-line ``ValueError``: :class:`PromptError`, ``rolecall.core.tokens.TokenIdError`` or
    ``rolecall.core.models.ContextLengthError``.

    ``vocab_size``: the model's (None: only negative ids are refused). ``max_new_tokens``: one count, or with
    ``per_row`` one per prompt; each at least ``least`` (``why``: the reason for more than 1). ``context``: the
    most tokens a prompt and its new tokens may take (None: not checked); with ``allow_long`` more only warns
    when ``warn_as`` names the program to warn as, and is not checked at all without (the caller opted in
    explicitly); ``opt_in`` names that option in the refusal (None: there is none). ``name``: the prompts' name in
    messages (``input_ids``, ``--prompts FILE``), ``new_name`` that of ``max_new_tokens``, ``row_names`` one name per
    prompt (default ``prompt N of NAME``), ``fix`` the remedy for too long a request, ``limit_name`` what
    ``context`` is (``{limit}``: its value)."""
    from rolecall.core.tokens import check_token_ids

    rows = _rows(prompts, name, row_names)
    if row_names is not None and len(row_names) != len(rows):
        raise ValueError(f"check_prompts: {len(row_names)} row names for {len(rows)} prompts")
    kept = rows if attention_mask is None else _kept(rows, attention_mask, prompts, name)
    for i, (row, ids) in enumerate(zip(rows, kept)):
        if not ids:
            masked = " (its attention_mask keeps none of its tokens)" if row else ""
            raise PromptError(f"{_name(i, name, row_names)} is empty{masked}; every prompt needs at least one token")
    if row_names is None:
        check_token_ids(rows, vocab_size, f"prompt {{n}} of {name}")
    else:
        for row, row_name in zip(rows, row_names):  # one sequence each: its name as it is
            check_token_ids([row], vocab_size, row_name)
    if per_row and isinstance(max_new_tokens, (list, tuple)):
        if len(max_new_tokens) != len(rows):
            raise PromptError(f"{new_name} gives {len(max_new_tokens)} values for {len(rows)} prompts; give one "
                              "value, or one per prompt")
        limits = [check_max_new_tokens(n, f"{new_name} of {_name(i, name, row_names)}", least, why)
                  for i, n in enumerate(max_new_tokens)]
    else:
        limits = [check_max_new_tokens(max_new_tokens, new_name, least, why)] * len(rows)
    if context is not None and not (allow_long and warn_as is None and opt_in):
        from rolecall.core.models import check_context

        longest = max(range(len(kept)), key=lambda i: len(kept[i]))
        who = row_names[longest] if row_names is not None else (
            f"the {'longest ' if len(kept) > 1 else ''}prompt of {name}")
        new = max(limits)
        check_context(len(kept[longest]) + new, context, what=f"{who} ({len(kept[longest])} tokens) plus {new_name} {new}",
                      fix=fix or f"shorten the prompt or lower {new_name}", allow_long=allow_long,
                      prog=warn_as or "rolecall", opt_in=opt_in, limit_name=limit_name)
    return kept


__all__ = ["API_OPT_IN", "PromptError", "check_max_new_tokens", "check_prompts"]
