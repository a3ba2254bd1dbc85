"""Attach a role manifest and a decode policy to a model: ``with attach(model, manifest, "delta"): ...``.

``session.generate(...)`` takes ``model.generate``'s arguments. On a GPU it runs the engine
(:mod:`rolecall.runtime.engine`: static cache, chunked prefill, CUDA-graph step, the policy's static step) whenever the
model's family, the policy and the arguments allow; otherwise it says in one line why and runs the reference
path below, transformers' own forward with rolecall's attention function (the CPU path, and the truth in tests).

Reference path: prefill (more than one query token) stays dense through SDPA; each decode step (one query token) of every
non-sliding layer goes through the policy's plan and the sparse-attention kernel. Sliding-window layers of
hybrid models (``rolecall.core.models.sliding_layers``) always run their own windowed attention and never call the
policy, so policies see, and hand selections between, the full-attention layers only. Everything runs inside
``rolecall.runtime.attention.use_attention``, so on exit the model is exactly what it was.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rolecall.core.manifest import RoleManifest
from rolecall.core.manifest.recommended import evidence_text, setting_text
from rolecall.core.models import cache_keyword, sliding_layers
from rolecall.runtime.attention import keep_mask, use_attention
from rolecall.runtime.kernels.page_scores import attention_probs
from rolecall.runtime.kernels.sparse_attention import indices_to_mask, sparse_decode_attention
from rolecall.runtime.policies import Plan, PolicyError, Step, get_policy


class LayerStats:
    """Running sums per layer: tokens read, tokens available, recall and relative error when recorded."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.read: list[Any] = [0] * num_layers  # Σ over steps, batch rows and KV heads of tokens read (tensors)
        self.available: list[Any] = [0] * num_layers  # Σ of the tokens a dense read would have read
        self.steps = [0] * num_layers
        self.recall: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # [B, Hq] per step
        self.error: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # [B, Hq] per step
        self.kept: list[float | None] = [None] * num_layers  # Lethe: kept fraction after the last step

    def attended_fraction(self) -> list[float | None]:
        return [float(r) / float(a) if float(a) else None for r, a in zip(self.read, self.available)]

    def summary(self) -> dict[str, Any]:
        def mean(xs: list[torch.Tensor]) -> float | None:
            return float(torch.cat([x.flatten() for x in xs]).mean()) if xs else None

        fractions = self.attended_fraction()
        total_read, total_avail = sum(float(r) for r in self.read), sum(float(a) for a in self.available)
        return {
            "attended_fraction": total_read / total_avail if total_avail else None,
            "layers": [
                {"layer": i, "steps": self.steps[i], "attended_fraction": fractions[i],
                 "recall": mean(self.recall[i]), "relative_error": mean(self.error[i]), "kept_fraction": self.kept[i]}
                for i in range(self.num_layers)
            ],
        }


class Session:
    """What :func:`attach` yields: the bound policy, per-request decode state and statistics."""

    def __init__(self, model: torch.nn.Module, manifest: RoleManifest | None, policy: Any,
                 record_recall: bool = False, record_error: bool = False, engine: str = "auto",
                 min_context: int | None = None, allow_long_context: bool = False) -> None:
        if engine not in ENGINE_CHOICES:
            raise PolicyError(f"engine must be one of {', '.join(ENGINE_CHOICES)}, got {engine!r}")
        if not isinstance(allow_long_context, bool):
            raise PolicyError(f"allow_long_context must be True or False, got {allow_long_context!r}")
        self.model, self.manifest, self.policy, self.engine = model, manifest, policy, engine
        self.allow_long_context = allow_long_context
        self._weights: Any = None  # the engine's weights, built at the first engine request
        self._decoders: Any = None  # the last engine request's decoder, kept for the next (rolecall.runtime.engine.Decoders)
        self._notice_given = False
        self.min_context = min_context
        self.last: Any = None  # the engine's Generation of the last call, when the engine ran
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.num_layers = int(config.num_hidden_layers)
        # Sliding-window layers keep their own attention under every policy: their window is their budget.
        self.dense_layers = set(sliding_layers(config))
        self.scratch: dict[str, Any] = {}
        self.spread = len({p.device for p in model.parameters()}) > 1  # a device map spread the model (see _on)
        self.cache_layers: dict[int, Any] = {}  # layer -> the evicting cache layer that served it last
        self.stats = LayerStats(self.num_layers)
        self.record_recall, self.record_error = record_recall, record_error
        self._sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    # -- public helpers ----------------------------------------------------------------------------------------
    @property
    def engine_weights(self) -> Any:
        """The engine's weights of the model (``rolecall.runtime.engine.Weights``: q/k/v and gate/up stacked into one
        matrix each) from this session's first engine request on, or None. Inside the session the model's own
        projections are views of the stacked matrices, so they cost no second copy; when the session ends the
        model gets standalone tensors back and these weights are spent."""
        return self._weights

    def cache(self):
        """A fresh cache for one request: the policy's own (Lethe evicts from it), else a DynamicCache."""
        make = getattr(self.policy, "make_cache", None)
        return make(self) if make else DynamicCache(config=self.model.config)

    def generate(self, *args: Any, **kwargs: Any):
        """``model.generate``'s arguments and outputs; the engine when :meth:`engine_reason` allows (then also
        ``seed=`` for sampling; the request's :class:`rolecall.runtime.engine.Generation` is ``self.last``),
        else ``model.generate`` on the reference path with a cache from :meth:`cache`. On the engine,
        ``output_logits=True`` gives one ``[B, V]`` per step as transformers does, but as views of one buffer
        in the model's dtype (transformers makes float32 copies; bf16 values are the same). The previous
        request's generation is freed when this one starts; its decoder is kept for the next request of the
        same kind that fits it (``rolecall.runtime.engine.Decoders``: the CUDA graphs replay instead of being
        captured again) and freed at the end of the session.

        Before anything runs, the request is checked (:meth:`check_request`); a bad one is refused in one line
        (``ValueError``) naming the value, the limit and the fix."""
        rows = self.check_request(args, kwargs)
        why = self.engine_reason(kwargs, args)
        self.last = None  # the previous request's generation (its logits, its prefill) is freed before this one runs
        if why is None:
            return self._generate_static(rows=rows, **kwargs)
        if self.engine == "static":
            raise PolicyError(f"engine='static' cannot run this request: {why}")
        if self._decoders is not None:
            self._decoders.clear()  # the transformers path needs the memory, not the engine's kept decoder
        if self.model.device.type == "cuda" and not self._notice_given:
            print(f"rolecall: decoding on the transformers path ({why})", file=sys.stderr)
            self._notice_given = True
        kwargs.pop("seed", None)
        if "cache" not in kwargs and "past_key_values" not in kwargs:  # a cache the caller gave, by either name
            kwargs[cache_keyword(self.model)] = self.cache()
        return self.model.generate(*args, **kwargs)

    def generate_on_engine(self, run: Callable[..., Any], **kwargs: Any):
        """:meth:`generate` (keyword arguments only) on the engine, with ``run`` in place of
        :func:`rolecall.runtime.engine.generate`: a function of its arguments that returns a
        :class:`~rolecall.runtime.engine.Generation` (the evaluation's
        :func:`rolecall.eval.decoding.traced_generate` keeps more of a request). A request the engine cannot
        run is refused in one line (``PolicyError``)."""
        rows = self.check_request((), kwargs)
        why = self.engine_reason(kwargs)
        if why is not None:
            raise PolicyError(f"this request needs the engine, which cannot run it: {why}")
        self.last = None
        return self._generate_static(rows=rows, run=run, **kwargs)

    def check_request(self, args: tuple, kwargs: dict[str, Any]) -> list[list[int]] | None:
        """``generate(*args, **kwargs)``'s prompts checked as :func:`rolecall.runtime.prompts.check_prompts` checks them:
        ``input_ids`` (or ``inputs``, or the first positional argument) a ``[batch, tokens]`` integer tensor of ids
        in the model's vocabulary, every row with a token its ``attention_mask`` (of the same shape) keeps,
        ``max_new_tokens`` (default: the generation config's, else 20) a whole number ≥ 1, and the longest row
        plus ``max_new_tokens`` within the model's context (``max_position_embeddings``) unless the session was
        attached with ``allow_long_context=True``. Returns each row's ids without those the mask drops (None for a
        request by ``inputs_embeds``, whose new tokens alone are checked)."""
        from rolecall.core.models import context_limit
        from rolecall.core.tokens import vocab_size
        from rolecall.runtime.prompts import PromptError, check_max_new_tokens, check_prompts

        given = kwargs.get("max_new_tokens")
        if given is None:
            gc = getattr(self.model, "generation_config", None)
            given = getattr(gc, "max_new_tokens", None) or 20
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if ids is None:
            if kwargs.get("inputs_embeds") is not None:
                check_max_new_tokens(given)
                return None
            raise PromptError("generate needs input_ids, a [batch, tokens] tensor of token ids (what a tokenizer "
                              "gives with return_tensors='pt')")
        rows = check_prompts(ids, vocab_size=vocab_size(self.config), max_new_tokens=given,
                             attention_mask=kwargs.get("attention_mask"), context=context_limit(self.model.config),
                             allow_long=self.allow_long_context)
        if not isinstance(ids, torch.Tensor):
            raise PromptError(f"generate takes input_ids as a [batch, tokens] tensor, as model.generate does, not a "
                              f"{type(ids).__name__}; torch.tensor(rows) makes one (rows of other lengths: "
                              "rolecall.runtime.engine.pad_left, with their attention_mask)")
        return rows

    def engine_reason(self, kwargs: dict[str, Any] | None = None, args: tuple = ()) -> str | None:
        """Why ``generate(**kwargs)`` cannot run on the engine (one line), or None when it runs there."""
        if self.engine == "reference":
            return "engine='reference' was asked for"
        if self.engine == "auto" and self.model.device.type != "cuda":
            return "the model is not on a CUDA device"
        from rolecall.runtime.engine.weights import placement_problem

        misplaced = placement_problem(self.model)
        if misplaced:
            return misplaced
        if self.record_recall or self.record_error:
            return "recording recall or error needs the measuring path"
        if self._engine_misfit:
            return self._engine_misfit
        extra = sorted(k for k in (kwargs or {}) if k not in ENGINE_KWARGS)
        if args or extra:
            return f"the engine does not take {', '.join(extra) or 'positional arguments'}"
        if (kwargs or {}).get("num_beams", 1) != 1:
            return "the engine does not beam-search"
        return None

    @functools.cached_property
    def _engine_misfit(self) -> str | None:
        """Why the model's family or the policy keeps every request off the engine, or None (checked once)."""
        from rolecall.runtime.engine import ModelShape, static_step_of, unsupported

        why = unsupported(self.model.config)
        if why:
            return why
        try:
            static_step_of(self.policy, ModelShape.from_config(self.model.config))
        except (NotImplementedError, PolicyError) as e:
            return str(e)
        return None

    def _generate_static(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                         top_p: float | None = None, top_k: int | None = None, seed: int = 0,
                         eos_token_id: Any = None, pad_token_id: int | None = None, stop_strings: Any = None,
                         tokenizer: Any = None, streamer: Any = None, output_logits: bool = False,
                         return_dict_in_generate: bool = False, num_beams: int = 1, use_cache: bool = True,
                         rows: list[list[int]] | None = None, run: Callable[..., Any] | None = None):
        """The engine's request; ``rows``: each row's ids without those ``attention_mask`` drops (left
        padding), as :meth:`check_request` gives them; ``run``: what runs it
        (:func:`rolecall.runtime.engine.generate` when None, see :meth:`generate_on_engine`)."""
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        from rolecall.runtime.engine import Decoders, Sampling, Weights, generate

        gc = self.model.generation_config
        ids = rows if rows is not None else self.check_request((), {"input_ids": input_ids,
                                                                    "attention_mask": attention_mask,
                                                                    "max_new_tokens": max_new_tokens})
        eos = eos_token_id if eos_token_id is not None else gc.eos_token_id
        pad = pad_token_id if pad_token_id is not None else (gc.pad_token_id if gc.pad_token_id is not None else
                                                             (eos if isinstance(eos, int) else (eos or [0])[0]))
        sample = bool(gc.do_sample if do_sample is None else do_sample)
        ignored = [f"{k}={v}" for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k))
                   if v is not None]
        if ignored and not sample:  # as transformers' generate says it, for the same call
            warnings.warn(f"{', '.join(ignored)} apply only with do_sample=True; this request decodes greedily",
                          UserWarning, stacklevel=3)
        sampling = Sampling(sample, float(temperature if temperature is not None else (gc.temperature or 1.0)),
                            int(top_k if top_k is not None else (gc.top_k or 0)) if sample else 0,
                            float(top_p if top_p is not None else (gc.top_p or 1.0)) if sample else 1.0, int(seed))
        new = int(max_new_tokens if max_new_tokens is not None else (gc.max_new_tokens or 20))
        need = max(len(r) for r in ids) + new
        positions = max(need, 1 << (need - 1).bit_length(), 4096)
        if self._weights is None or not self._weights.taken_from(self.model):
            self.close()  # weights this session took from the model before it was moved or cast
            self._weights = Weights.from_model(self.model, positions=positions, share=True)
        elif self._weights.max_positions < need:  # new weights: the kept decoder (the old ones') is freed by generate
            self._weights = self._weights.with_positions(self.model, positions)
        self._decoders = self._decoders or Decoders()
        stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
        out = (run or generate)(self._weights, self.policy, ids, max_new_tokens=new, sampling=sampling,
                                eos_token_id=eos, pad_token_id=int(pad), stop_strings=stops,
                                tokenizer=tokenizer, streamer=streamer, output_logits=output_logits,
                                min_context=self.min_context, decoders=self._decoders)
        self.last = out
        width = max(len(t) for t in out.tokens)
        rows = [t + [int(pad)] * (width - len(t)) for t in out.tokens]
        sequences = torch.cat([input_ids, torch.tensor(rows, dtype=input_ids.dtype).to(input_ids.device)], 1)
        if not return_dict_in_generate:
            return sequences
        logits = None
        if output_logits:  # as transformers gives them, one [B, V] per step, but views in the model's dtype (no
            # copy: at a large vocabulary a batch's logits are gigabytes); the engine ran at least ``width`` steps
            logits = tuple(out.step_logits[:, :width].to(input_ids.device).unbind(1))
        return GenerateDecoderOnlyOutput(sequences=sequences, logits=logits)

    def close(self) -> None:
        """The model's projections standalone again where this session's engine weights took them as views (at
        the end of :func:`attach`); those weights are spent then."""
        if self._decoders is not None:
            self._decoders.clear()
        if self._weights is not None:
            self._weights.release(self.model)

    def reset_stats(self) -> None:
        self.stats = LayerStats(self.num_layers)

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy.name, **self.stats.summary()}

    # -- the attention function --------------------------------------------------------------------------------
    def _physical(self, layer: int, key: torch.Tensor):
        """The evicting cache layer whose storage ``key`` is, or None (then slots = positions)."""
        cl = self.cache_layers.get(layer)
        return cl if cl is not None and cl.keys is key else None

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        b, hq, s, d = query.shape
        t = key.shape[2]
        scale = scaling if scaling is not None else d ** -0.5
        cache_layer = self._physical(layer, key)
        if s != 1 or layer in self.dense_layers:
            if s == t and layer == 0:  # a new request starts with a prefill of an empty cache
                self.scratch.clear()
                reset = getattr(self.policy, "reset", None)
                if reset:
                    reset()
            if cache_layer is not None and not cache_layer.contiguous():
                attention_mask = cache_layer.gather_mask(keep_mask(attention_mask, s, cache_layer.seen, query.device))
            return self._sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

        logical = cache_layer.seen if cache_layer is not None else t
        keep_logical = keep_mask(attention_mask, 1, logical, query.device)[:, 0, -1, :].expand(b, logical)  # [B, T]
        keep = keep_logical.gather(1, cache_layer.positions) if cache_layer is not None else keep_logical
        q = query[:, :, 0, :]  # [B, Hq, D]
        with self._on(key.device):
            step = Step(layer, q, key, value, keep, scale, self.scratch, cache_layer)
            plan: Plan = self.policy.plan(step)
            mask = plan.key_mask if plan.key_mask is not None else keep
            out, _ = sparse_decode_attention(q, key, value, plan.indices, scale=scale, block_size=plan.block_size,
                                             log_weights=plan.log_weights, key_mask=mask)  # [B, Hq, D]
            self._record(layer, step, plan, mask, out, keep_logical.sum())
        return out[:, None].to(query.dtype), None  # [B, 1, Hq, D]

    def _on(self, device: torch.device):
        """Where a device map spread the model: the layer's GPU made current (the Triton kernels launch on the
        current one), and what earlier layers left in the scratch moved to it. Elsewhere nothing to do."""
        if not self.spread:
            return contextlib.nullcontext()
        for name, held in self.scratch.items():
            if isinstance(held, torch.Tensor) and held.device != device:
                self.scratch[name] = held.to(device)
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def _record(self, layer: int, step: Step, plan: Plan, mask: torch.Tensor, out: torch.Tensor,
                available: torch.Tensor) -> None:
        # Sums stay on the device (no host sync per layer); summary() reads them once.
        b, hkv, t = step.key.shape[:3]
        read = indices_to_mask(plan.indices, plan.block_size, t, (b, hkv)).to(mask.device) & mask[:, None, :]
        st = self.stats
        st.read[layer] += read.sum()
        st.available[layer] += available * hkv
        st.steps[layer] += 1
        if "kept_fraction" in plan.info:
            st.kept[layer] = plan.info["kept_fraction"]
        if self.record_recall:
            probs = attention_probs(step.query, step.key, step.scale, step.keep)  # [B, Hq, T]
            st.recall[layer].append((probs * read.repeat_interleave(step.groups, dim=1)).sum(-1).cpu())
        if self.record_error:
            dense, _ = sparse_decode_attention(step.query, step.key, step.value, scale=step.scale, key_mask=step.keep)
            err = (out - dense).norm(dim=-1) / dense.norm(dim=-1).clamp_min(1e-30)  # [B, Hq]
            st.error[layer].append(err.cpu())


ENGINE_CHOICES = ("auto", "static", "reference")
# attach() keywords that are not the policy's (how to decode, what to record)
SESSION_PARAMS = ("record_recall", "record_error", "engine", "min_context", "allow_long_context")
# model.generate arguments the engine honours (the rest send a request to the reference path)
ENGINE_KWARGS = {"input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_p", "top_k",
                 "seed", "eos_token_id", "pad_token_id", "stop_strings", "tokenizer", "streamer", "output_logits",
                 "return_dict_in_generate", "num_beams", "use_cache"}


def _load_manifest(manifest: RoleManifest | str | os.PathLike | None) -> RoleManifest | None:
    if manifest is None or isinstance(manifest, RoleManifest):
        return manifest
    return RoleManifest.load(manifest)


DEFAULT_POLICY = "delta"  # what a session decodes with when neither the caller nor the manifest names a policy


def chosen_setting(policy: str | Any | None, manifest: RoleManifest | None,
                   params: dict[str, Any]) -> tuple[str | Any, dict[str, Any], str | None]:
    """The policy and parameters a session decodes with, and the one line that says where they came from.

    A ``policy`` given (a name or an object) is used as given with ``params``. Without one (None), the manifest's
    recommended setting (``RoleManifest.recommended``, written by ``rolecall tune``) is used, the caller's
    ``params`` over its own, and the line names it and its evidence; without a recommendation, ``delta`` with
    ``params`` and no line."""
    if policy is not None:
        return policy, params, None
    recommended = getattr(manifest, "recommended", None) or {}
    if not recommended:
        return DEFAULT_POLICY, params, None
    merged = {**recommended.get("params", {}), **params}
    why = evidence_text(recommended.get("evidence", {}))
    why = f" ({why})" if why else ""
    line = (f"rolecall: decoding with {setting_text(recommended['policy'], merged)}, the manifest's recommended "
            f"setting{why}; name a policy to override it")
    return recommended["policy"], merged, line


def bound_policy(policy: str | Any, manifest: RoleManifest | None, config: Any, **params: Any) -> Any:
    """``policy`` (a name or a policy object) made from ``params``, with ``manifest`` checked against the model's
    ``config`` and bound to it: what :func:`attach` does before it decodes, which needs no weights (the commands
    run it on the config alone, so a manifest the model or the policy cannot use fails before any weight loads)."""
    pol = get_policy(policy, **params)
    if manifest is not None:
        manifest.validate_for(config)
    pol.bind(manifest, config)
    return pol


@contextmanager
def attach(model: torch.nn.Module, manifest: RoleManifest | str | os.PathLike | None = None,
           policy: str | Any | None = None, **params: Any) -> Iterator[Session]:
    """Decode ``model`` with ``policy`` (a name from ``rolecall.runtime.policies.POLICIES`` or a policy object) and
    ``manifest`` (a RoleManifest or a path) inside the ``with`` block; yields a :class:`Session`. Without a
    ``policy``, the manifest's recommended setting (``rolecall tune``) when it has one, said in one line on
    stderr, else ``delta`` (:func:`chosen_setting`).

    ``params`` go to the policy, except ``record_recall`` / ``record_error`` (bool, default False): also
    measure per layer the true attention mass inside the read set and the relative error of each head's
    output against dense attention (costs a dense pass per step, on the reference path; for evaluation), and
    ``engine``: ``"auto"`` (the engine on CUDA where it can run, default), ``"static"`` (the engine or an
    error, also on the CPU) or ``"reference"`` (always the transformers path); ``min_context``: below this
    many tokens the engine runs a sparse policy's full step (default: the measured crossover for the policy
    and batch, :func:`rolecall.runtime.engine.default_min_context`; 0 = always sparse, as evaluation needs);
    ``allow_long_context`` (default False): decode prompts whose tokens and new tokens pass the model's context
    (``max_position_embeddings``), for a model whose RoPE was extended on purpose, as ``--allow-long-context``
    does in the commands; without it such a request is refused in one line before it runs.
    """
    record_recall = bool(params.pop("record_recall", False))
    record_error = bool(params.pop("record_error", False))
    engine = params.pop("engine", "auto")
    min_context = params.pop("min_context", None)
    allow_long_context = params.pop("allow_long_context", False)
    manifest = _load_manifest(manifest)
    policy, params, line = chosen_setting(policy, manifest, params)
    if line:
        print(line, file=sys.stderr)
    pol = bound_policy(policy, manifest, model.config, **params)
    current = model.config._attn_implementation or ""
    if current.startswith("rolecall"):
        raise PolicyError(f"this model already runs rolecall attention ({current}); leave that attach() block first")
    session = Session(model, manifest, pol, record_recall, record_error, engine, min_context, allow_long_context)
    with use_attention(model, session.attention, name=f"rolecall_{pol.name}"):
        try:
            yield session
        finally:
            session.close()


__all__ = ["DEFAULT_POLICY", "LayerStats", "Session", "attach", "bound_policy", "chosen_setting"]
