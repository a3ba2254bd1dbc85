"""rolecall.runtime.engine: the static decoder against the truth (transformers' forward with rolecall's attention hook),
sampling, stopping, the short-context fallback, attach()'s restoration and the engine's scope."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, TopKLogitsWarper, TopPLogitsWarper

import rolecall.runtime.engine as engine
from rolecall.core.manifest import ModelIdentity, RoleManifest
from rolecall.eval.decoding import traced_generate
from rolecall.runtime import attach
from rolecall.runtime.engine import Generation, Sampling, Weights, default_min_context, unsupported
from rolecall.runtime.engine.generate import MIN_SLOTS
from rolecall.runtime.engine.sampling import Sampler, filtered_logits
from rolecall.runtime.engine.weights import placement_problem
from rolecall.runtime.policies import PolicyError, get_policy
from tests.tiny import tiny_config, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
POLICIES = ["full", "delta", "delta-per-head", "delta-refine", "lychee", "quest", "vattention", "vattention-delta",
            "lethe"]
# Parameters with which the sparse policies really drop tokens at ~90-token contexts.
PARAMS = {"full": {}, "delta": {"budget": 32, "recent_pages": 1}, "lychee": {"budget": 32, "block_size": 16},
          "quest": {"budget": 32, "page_size": 16, "dense_layers": 1},
          "delta-per-head": {"budget": 32, "recent_pages": 1, "per_head": True},
          "delta-refine": {"budget": 32, "recent_pages": 1, "refine": 2},
          "vattention": {"epsilon": 0.3, "delta": 0.3, "sinks": 2, "window": 8, "heavy": 8, "pilot": 8, "max_sample": 24},
          "vattention-delta": {"epsilon": 0.3, "delta": 0.3, "sinks": 2, "window": 8, "heavy": 8, "pilot": 8,
                               "max_sample": 24},
          "lethe": {"budget": 40, "sinks": 2, "recent_ratio": 0.2, "segments": 3, "tau": 0.9}}
PAD = 259
NEW = 12
LENGTHS = (90, 70, 81)
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
WITH_LOGITS = dict(GREEDY, output_logits=True, return_dict_in_generate=True)


# -- helpers ---------------------------------------------------------------------------------------------------
def model_of(family: str, seed: int = 0) -> torch.nn.Module:
    # Gemma 3's tiny hybrid puts its full-attention layers at 2 and 5 (six layers).
    return tiny_model(family, seed=seed, layers=6 if family == "gemma3" else 4, heads=4, kv_heads=2, head_dim=16)


def manifest_of(model, policy: str) -> RoleManifest | None:
    identity = ModelIdentity.from_config(model.config)
    layers = model.config.num_hidden_layers
    if "delta" in policy:  # Gemma 3: only the full layers 2 (Δ) and 5 (sparse) count; sliding roles are ignored
        roles = [0, 0, 1, 0, 0, 2] if layers == 6 else [0, 1, 2, 2]
        return RoleManifest(identity, layer_role=torch.tensor(roles, dtype=torch.int8))
    if policy == "lychee":
        heads = [[1, 1], [0, 1], [0, 0], [1, 0]] + ([[0, 0], [0, 1]] if layers == 6 else [])
        return RoleManifest(identity, head_role=torch.tensor(heads, dtype=torch.int8))
    return None


def prompts(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def run(model, policy: str, engine_kind: str, ids, mask=None, min_context=0, **gen):
    kw = {} if min_context == "default" else {"min_context": min_context}
    name = policy.split("-")[0]  # "delta-per-head" is delta with per_head=True, "delta-refine" with refine=2
    with attach(model, manifest_of(model, policy), name, engine=engine_kind, **kw, **PARAMS[policy]) as s:
        out = s.generate(input_ids=ids, attention_mask=mask, **(gen or WITH_LOGITS))
        last = s.last
    if engine_kind == "static":
        assert isinstance(last, Generation), "engine='static' did not run the engine"
    else:
        assert last is None, "engine='reference' ran the engine"
    return out


def active_steps(sequences: torch.Tensor, prompt_width: int, eos) -> list[int]:
    """Per row, the generated steps up to and including its first EOS (where its logits mean something)."""
    eos = {eos} if isinstance(eos, int) else set(eos)
    counts = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        counts.append(end)
    return counts


def max_logit_gap(a, b, steps: list[int]) -> float:
    """Largest |a - b| over each row's first ``steps[row]`` generated positions."""
    gap = 0.0
    for row, n in enumerate(steps):
        for i in range(n):
            gap = max(gap, float((a[i][row] - b[i][row]).abs().max()))
    return gap


# -- 1. the engine equals the reference path, and sparse policies really drop something -------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_equals_reference(family, policy):
    model = model_of(family)
    rows = prompts()
    ids, mask = left_padded(rows)
    if policy == "delta-refine" and family == "mistral":  # a window on every layer: no engine step, it says so
        with pytest.raises(PolicyError, match="no engine step for sliding-window sparse layers"):
            run(model, policy, "static", ids, mask)
        return
    cases = {"batch 1": (torch.tensor([rows[0]]), None), "ragged batch": (ids, mask)}
    for name, (x, m) in cases.items():
        got = run(model, policy, "static", x, m)
        want = run(model, policy, "reference", x, m)
        assert torch.equal(got.sequences, want.sequences), f"{family}/{policy}/{name}: tokens differ"
        steps = active_steps(want.sequences, x.shape[1], model.generation_config.eos_token_id)
        assert len(got.logits) == len(want.logits) == max(steps)
        gap = max_logit_gap(got.logits, want.logits, steps)
        assert gap <= 1e-4, f"{family}/{policy}/{name}: logits differ by {gap:.2e}"
        if policy != "full":  # the sparse step must really drop tokens at these lengths
            dense = run(model, "full", "reference", x, m)
            first = [min(n, len(dense.logits)) for n in steps]
            assert max_logit_gap(want.logits, dense.logits, first) > 1e-2, \
                f"{family}/{policy}/{name}: the sparse policy read everything"


def test_logits_after_eos_match_transformers():
    model = model_of("llama")
    ids, mask = left_padded(prompts())
    free = model.generate(input_ids=ids, attention_mask=mask, **dict(WITH_LOGITS, eos_token_id=None))
    eos = int(free.sequences[1, ids.shape[1] + 1])  # row 1 stops after two tokens
    gen = dict(WITH_LOGITS, eos_token_id=eos)
    want = model.generate(input_ids=ids, attention_mask=mask, **gen)
    steps = active_steps(want.sequences, ids.shape[1], eos)
    assert min(steps) < len(want.logits), "no row finished early: the test needs a row that hits EOS"
    got = run(model, "full", "static", ids, mask, **gen)
    assert torch.equal(got.sequences, want.sequences)
    assert max_logit_gap(got.logits, want.logits, steps) <= 1e-4  # up to each row's EOS: equal
    assert max_logit_gap(got.logits, want.logits, [len(want.logits)] * len(steps)) <= 1e-4  # after it: zeros


VARIANTS = {
    "tied+bias": ("llama", dict(tie_word_embeddings=True, attention_bias=True)),
    "softcap": ("gemma3", dict(final_logit_softcapping=5.0)),
    "llama3-rope": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "linear-rope": ("qwen2", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "window-everywhere": ("mistral", dict(sliding_window=16)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_equals_reference_on_config_variants(variant):
    family, overrides = VARIANTS[variant]
    model = tiny_model(family, layers=6 if family == "gemma3" else 4, heads=4, kv_heads=2, head_dim=16, **overrides)
    ids, mask = left_padded(prompts(seed=2))
    for policy in POLICIES:
        if policy == "delta-refine" and variant == "window-everywhere":  # no engine step there: it says so
            with pytest.raises(PolicyError, match="no engine step for sliding-window sparse layers"):
                run(model, policy, "static", ids, mask)
            continue
        got = run(model, policy, "static", ids, mask)
        want = run(model, policy, "reference", ids, mask)
        assert torch.equal(got.sequences, want.sequences), policy
        steps = active_steps(want.sequences, ids.shape[1], model.generation_config.eos_token_id)
        assert max_logit_gap(got.logits, want.logits, steps) <= 1e-4, policy


# -- 2. full attention on the engine equals plain model.generate -----------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_full_engine_equals_plain_generate(family):
    model = model_of(family, seed=1)
    ids, mask = left_padded(prompts(seed=1))
    want = model.generate(input_ids=ids, attention_mask=mask, **WITH_LOGITS)
    got = run(model, "full", "static", ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    steps = active_steps(want.sequences, ids.shape[1], model.generation_config.eos_token_id)
    assert max_logit_gap(got.logits, want.logits, steps) <= 1e-4
    # the same without return_dict: plain sequences
    seqs = run(model, "full", "static", ids, mask, **GREEDY)
    assert torch.equal(seqs, want.sequences)


# -- 3. sampling ---------------------------------------------------------------------------------------------
SAMPLE = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, pad_token_id=PAD)


def test_sampling_is_seeded_and_stays_inside_the_filter():
    model = model_of("qwen3")
    ids, mask = left_padded(prompts())
    a = run(model, "delta", "static", ids, mask, seed=7, output_logits=True, return_dict_in_generate=True, **SAMPLE)
    b = run(model, "delta", "static", ids, mask, seed=7, **SAMPLE)
    c = run(model, "delta", "static", ids, mask, seed=8, **SAMPLE)
    assert torch.equal(a.sequences, b)
    assert not torch.equal(b, c)
    greedy = run(model, "delta", "static", ids, mask, **GREEDY)
    assert not torch.equal(b, greedy)
    # every sampled token is inside top-k ∩ top-p of its step's logits / T
    new = a.sequences[:, ids.shape[1]:]
    steps = active_steps(a.sequences, ids.shape[1], model.generation_config.eos_token_id)
    for row, n in enumerate(steps):
        for i in range(n):
            kept = filtered_logits(a.logits[i][row:row + 1] / 0.8, 20, 0.9)[0]
            assert torch.isfinite(kept[new[row, i]]), f"row {row} step {i}: token outside the filter"


def test_engine_samples_what_the_sampler_draws_from_its_logits():
    # the step's choice is the Sampler's (counter step 0 at the prefill, then one per step) on the step's logits
    model = model_of("gemma3")
    rows = prompts()
    sampling = Sampling(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    w = Weights.from_model(model, positions=256)
    out = engine.generate(w, get_policy("full"), rows, max_new_tokens=NEW, sampling=sampling, pad_token_id=PAD,
                          eos_token_id=[], output_logits=True, kernels="naive")
    sampler = Sampler(sampling, "cpu")
    drawn = torch.stack([sampler(torch.stack([lg[i] for lg in out.logits])) for i in range(NEW)], 1)
    assert drawn.tolist() == out.tokens


def test_sampling_with_top_k_1_is_greedy():
    model = model_of("llama")
    ids, mask = left_padded(prompts())
    greedy = run(model, "full", "static", ids, mask, **GREEDY)
    one = run(model, "full", "static", ids, mask, seed=3, **dict(SAMPLE, top_k=1, top_p=1.0))
    assert torch.equal(one, greedy)


def test_filtered_logits_by_hand():
    inf = float("-inf")
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    assert torch.equal(filtered_logits(x, 3, 1.0), torch.tensor([[1.0, 3.0, 2.0, inf, inf]]))
    assert torch.equal(filtered_logits(x, 0, 1.0), x)  # both off
    assert torch.equal(filtered_logits(x, 10, 1.0), x)  # k beyond the vocabulary: off

    p = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]).log()
    assert torch.isfinite(filtered_logits(p, 0, 0.7)).tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(filtered_logits(p, 0, 0.85)).tolist() == [[True, True, True, False, False]]
    assert torch.isfinite(filtered_logits(p, 0, 0.01)).tolist() == [[True, False, False, False, False]]  # top stays
    # exact boundary: four equal tokens, the mass before the third is exactly 0.5, so top_p 0.5 keeps two (as
    # transformers does)
    assert int(torch.isfinite(filtered_logits(torch.zeros(1, 4), 0, 0.5)).sum()) == 2
    kept = filtered_logits(p, 0, 0.7)
    assert torch.equal(kept[0, :2], p[0, :2])  # kept logits are untouched

    # top-k first, then top-p on the renormalised rest: p = .4 .3 .2 .1, k = 2 -> .571 .429; top_p .5 keeps one
    # (top-p first would keep .4 and .3)
    q = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log()
    assert torch.isfinite(filtered_logits(q, 2, 0.5)).tolist() == [[False, True, False, False]]
    assert torch.isfinite(filtered_logits(q, 3, 0.6)).tolist() == [[False, True, False, True]]

    # rows are filtered independently
    two = torch.cat([p, p.flip(-1)])
    assert torch.isfinite(filtered_logits(two, 0, 0.7)).tolist() == [[True, True, False, False, False],
                                                                      [False, False, False, True, True]]


def test_filtered_logits_agrees_with_transformers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=g) * 2
    for k, p in [(5, 1.0), (0, 0.9), (20, 0.9), (10, 0.5), (0, 0.3)]:
        want = x
        if k:
            want = TopKLogitsWarper(k)(None, want)
        if p < 1:
            want = TopPLogitsWarper(p)(None, want)
        assert torch.equal(filtered_logits(x, k, p), want), (k, p)


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampler_draws_follow_the_softmax(top_k):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    t, draws = 0.8, 4000
    sampler = Sampler(Sampling(do_sample=True, temperature=t, top_k=top_k, seed=11), "cpu")
    counts = torch.zeros(5)
    for _ in range(draws):
        counts[sampler(logits)] += 1
    want = torch.softmax(filtered_logits(logits / t, top_k, 1.0), -1)[0]
    assert float((counts / draws - want).abs().max()) < 0.03, (counts / draws, want)
    if top_k:
        assert counts[top_k:].sum() == 0
    assert int(sampler.step) == draws  # one step of the counter-based hash per call
    assert int(Sampler(Sampling(), "cpu")(logits)) == 0  # do_sample=False: greedy


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_reference_logits_are_full_attention_along_the_generated_tokens(family):
    """``reference_logits``: one dense pass over the generated tokens on the prompt's cached K/V gives what one
    transformers forward over prompt and trace gives at those positions (a ragged batch; Gemma 3's windows); for
    ``full`` they are its own step logits, for ``delta`` and Lethe they differ from its steps. Lethe evicts prompt
    keys, so its reference reads a copy of the prefill in a full-attention cache."""
    model = model_of(family)
    rows = prompts()
    w = Weights.from_model(model, positions=256)
    for policy in ("full", "delta", "lethe"):
        pol = get_policy(policy.split("-")[0], **PARAMS[policy])
        pol.bind(manifest_of(model, policy), model.config)
        out = traced_generate(w, pol, rows, max_new_tokens=NEW, pad_token_id=PAD, kernels="naive",
                              output_logits=True, reference_logits=True, min_context=0)
        assert out.prefilled is None  # the copy Lethe's reference read is not kept unless asked for
        for r, prompt in enumerate(rows):
            ref = out.reference_logits[r]
            assert ref.shape == (NEW - 1, model.config.vocab_size)
            with torch.no_grad():
                want = model(torch.tensor([prompt + out.tokens[r][:-1]])).logits[0, len(prompt):]
            assert float((ref - want).abs().max()) < 1e-4, (family, policy, r)
            gap = float((ref - out.logits[r][1:]).abs().max())
            assert gap < 1e-4 if policy == "full" else gap > 1e-2, (family, policy, r, gap)


def test_an_evicting_policys_decoder_is_freed_before_its_reference_decoder_is_built(monkeypatch):
    """Lethe's reference needs a full-attention cache of the whole prompt: its own decoder (cache, graphs) is
    gone by then, so the two never take memory at once (garbage collection off: only the freed counts)."""
    import gc
    import weakref

    from rolecall.runtime.engine import StaticDecoder

    built = []
    init = StaticDecoder.__init__

    def watched(self, *args, **kwargs):
        built.append((weakref.ref(self), [ref() is not None for ref, _ in built]))
        init(self, *args, **kwargs)

    monkeypatch.setattr(StaticDecoder, "__init__", watched)
    model = model_of("llama")
    w = Weights.from_model(model, positions=256)
    pol = get_policy("lethe", **PARAMS["lethe"])
    pol.bind(manifest_of(model, "lethe"), model.config)
    gc.collect()
    gc.disable()
    try:
        out = traced_generate(w, pol, prompts(), max_new_tokens=NEW, pad_token_id=PAD, kernels="naive",
                              reference_logits=True, min_context=0)
    finally:
        gc.enable()
    assert len(built) == 2 and built[1][1] == [False]  # the policy's, then the full one once it was freed
    assert len(out.reference_logits) == len(prompts())


# -- 4. stopping -----------------------------------------------------------------------------------------------
def test_per_row_eos_equals_reference():
    model = model_of("llama")
    rows = prompts()
    ids, mask = left_padded(rows)
    w = Weights.from_model(model, positions=256)
    free = engine.generate(w, get_policy("full"), rows, max_new_tokens=NEW, pad_token_id=PAD, kernels="naive")
    # an EOS that one row emits early and another row never emits
    eos = next(t for i in range(1, 6) for r, out in enumerate(free.tokens) for t in [out[i]]
               if t not in out[:i] and any(t not in other for other in free.tokens))
    hits = [out.index(eos) + 1 if eos in out else None for out in free.tokens]

    out = engine.generate(w, get_policy("full"), rows, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos,
                          kernels="naive")
    for r, n in enumerate(hits):
        assert out.finish[r] == ("eos" if n else "length")
        assert out.tokens[r] == (free.tokens[r][:n] if n else free.tokens[r])
    assert out.prompt_lengths == list(LENGTHS)

    want = model.generate(input_ids=ids, attention_mask=mask, **dict(GREEDY, eos_token_id=eos))
    got = run(model, "full", "static", ids, mask, **dict(GREEDY, eos_token_id=eos))
    assert torch.equal(got, want)


def test_every_row_stopping_early_ends_the_batch():
    model = model_of("qwen2")
    rows = prompts()
    ids, mask = left_padded(rows)
    w = Weights.from_model(model, positions=256)
    free = engine.generate(w, get_policy("full"), rows, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=[],
                           kernels="naive")
    eos = [out[2] for out in free.tokens]  # each row stops at its third token or earlier
    out = engine.generate(w, get_policy("full"), rows, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos,
                          kernels="naive")
    assert out.finish == ["eos"] * 3
    assert all(len(t) <= 3 and t[-1] in eos for t in out.tokens)
    assert out.steps < NEW - 1  # the host stopped stepping once every row was done
    want = model.generate(input_ids=ids, attention_mask=mask, **dict(GREEDY, eos_token_id=eos))
    got = run(model, "full", "static", ids, mask, **dict(GREEDY, eos_token_id=eos))
    assert got.shape[1] == want.shape[1] <= ids.shape[1] + 3
    assert torch.equal(got, want)


def test_max_new_tokens_per_row_and_in_a_session():
    model = model_of("mistral")
    rows = prompts()
    w = Weights.from_model(model, positions=256)
    free = engine.generate(w, get_policy("full"), rows, max_new_tokens=NEW, pad_token_id=PAD, kernels="naive")
    out = engine.generate(w, get_policy("full"), rows, max_new_tokens=[3, NEW, 7], pad_token_id=PAD, kernels="naive")
    assert [len(t) for t in out.tokens] == [3, NEW, 7]
    assert out.finish == ["length"] * 3
    assert out.tokens == [free.tokens[0][:3], free.tokens[1], free.tokens[2][:7]]
    one = engine.generate(w, get_policy("full"), rows, max_new_tokens=1, pad_token_id=PAD, kernels="naive")
    assert one.tokens == [t[:1] for t in free.tokens] and one.steps == 0

    ids, mask = left_padded(rows)
    want = model.generate(input_ids=ids, attention_mask=mask, **dict(GREEDY, max_new_tokens=5, eos_token_id=None))
    got = run(model, "full", "static", ids, mask, **dict(GREEDY, max_new_tokens=5, eos_token_id=[]))
    assert got.shape == (3, ids.shape[1] + 5)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(w, get_policy("full"), rows, max_new_tokens=[3, 4], pad_token_id=PAD)


def unstopped_run():
    """The stop-string tests' baseline: tokenizer, prompts, weights and 24 tokens a row with no stop string."""
    rows = prompts(seed=1)
    w = Weights.from_model(model_of("llama"), positions=256)
    free = engine.generate(w, get_policy("full"), rows, max_new_tokens=24, pad_token_id=PAD, kernels="naive")
    return tiny_tokenizer(), rows, w, free


def test_stop_strings_cut_after_the_string():
    tok, rows, w, free = unstopped_run()

    # a two-character stop string made of two printable byte tokens (ids 0-93 are bytes 33-126) that some row emits
    def candidate(out):
        for k in range(1, len(out) - 1):
            if out[k] < 94 and out[k + 1] < 94:
                stop = tok.decode(out[k:k + 2])
                if stop not in tok.decode(out[:k + 1]):
                    return k, stop
        return None

    found = [(r, c) for r, out in enumerate(free.tokens) if (c := candidate(out))]
    assert found, "no row emitted two printable tokens in a row: pick another seed"
    row, (k, stop) = found[0]
    out = engine.generate(w, get_policy("full"), rows, max_new_tokens=24, pad_token_id=PAD, stop_strings=[stop],
                          tokenizer=tok, kernels="naive")
    for r, ids in enumerate(free.tokens):
        # the independent reference: the shortest prefix whose text contains the stop string
        n = next((n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n], skip_special_tokens=True)), None)
        if n is None:
            assert out.finish[r] == "length" and out.tokens[r] == ids
        else:
            assert out.finish[r] == "stop" and out.tokens[r] == ids[:n]
    assert out.tokens[row] == free.tokens[row][:k + 2]
    assert tok.decode(out.tokens[row]).endswith(stop)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(w, get_policy("full"), rows, max_new_tokens=4, stop_strings=[stop])


def test_stop_strings_on_every_row_end_the_batch():
    tok, rows, w, free = unstopped_run()
    # per row the first printable byte token within its first 8 tokens, as a one-character stop string
    stops = [tok.decode([t]) for out in free.tokens for t in [next(t for t in out[:8] if t < 94)]]
    out = engine.generate(w, get_policy("full"), rows, max_new_tokens=24, pad_token_id=PAD, stop_strings=stops,
                          tokenizer=tok, check_every=8, kernels="naive")
    assert out.finish == ["stop"] * 3
    assert all(len(t) <= 8 for t in out.tokens)
    assert out.steps == 8  # the first check saw every row stopped


class Collect:
    """A streamer that keeps the ids it is given after the prompt (the first call, as transformers makes it)."""

    def __init__(self):
        self.ids, self.ended, self.prompt = [], 0, None

    def put(self, ids):
        if self.prompt is None:
            self.prompt = torch.as_tensor(ids).flatten().tolist()
            return
        self.ids += torch.as_tensor(ids).flatten().tolist()

    def end(self):
        self.ended += 1


def test_streamer_gets_row_0():
    model = model_of("qwen3")
    rows = prompts()
    w = Weights.from_model(model, positions=256)
    streamer = Collect()
    out = engine.generate(w, get_policy("full"), rows, max_new_tokens=20, pad_token_id=PAD, streamer=streamer,
                          check_every=3, kernels="naive")
    assert streamer.ended == 1
    assert streamer.ids == out.tokens[0]  # no stop: every token, streamed in pieces of 3


def test_text_streamer_prints_what_transformers_prints(capsys):
    """transformers' TextStreamer (skip_prompt=True, as rolecall decode uses it) prints the same text for the
    engine as for model.generate: the prompt goes first and is skipped, then the generated text."""
    from transformers import TextStreamer

    tok = tiny_tokenizer()
    model = model_of("llama")
    ids = torch.tensor([prompts(seed=1)[1]])
    kw = dict(input_ids=ids, max_new_tokens=16, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    model.generate(**kw, streamer=TextStreamer(tok, skip_prompt=True))
    want = capsys.readouterr().out
    with attach(model, None, "full", engine="static") as session:
        out = session.generate(**kw, streamer=TextStreamer(tok, skip_prompt=True))
    got = capsys.readouterr().out
    assert got == want and got.strip() == tok.decode(out[0, ids.shape[1]:]).strip() and len(got.strip()) > 0


def test_sampling_arguments_of_a_greedy_request_are_named_in_a_warning_and_change_nothing():
    """As transformers' generate does on the same call: the request stays greedy, and says so."""
    model = model_of("llama")
    ids = torch.tensor([prompts(seed=1)[1]])
    kw = dict(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with attach(model, None, "full", engine="static") as session:
        greedy = session.generate(**kw)
        with pytest.warns(UserWarning, match=r"^temperature=0\.5, top_k=3 apply only with do_sample=True; this "
                                             r"request decodes greedily$"):
            told = session.generate(**kw, temperature=0.5, top_k=3)
    assert torch.equal(told, greedy)


def test_streamer_stops_at_the_stop_string():
    tok = tiny_tokenizer()
    model = model_of("llama")
    row = prompts(seed=1)[1]
    w = Weights.from_model(model, positions=256)
    free = engine.generate(w, get_policy("full"), [row], max_new_tokens=24, pad_token_id=PAD, kernels="naive")
    stop = tok.decode(free.tokens[0][2:4])
    assert stop not in tok.decode(free.tokens[0][:3])
    streamer = Collect()
    out = engine.generate(w, get_policy("full"), [row], max_new_tokens=24, pad_token_id=PAD, stop_strings=[stop],
                          tokenizer=tok, streamer=streamer, kernels="naive")
    assert out.finish == ["stop"] and out.tokens[0] == free.tokens[0][:4]
    assert streamer.ids == out.tokens[0]


def test_streamer_stops_at_eos():
    model = model_of("llama")
    row = prompts(seed=1)[1]
    w = Weights.from_model(model, positions=256)
    free = engine.generate(w, get_policy("full"), [row], max_new_tokens=24, pad_token_id=PAD, kernels="naive")
    eos = free.tokens[0][2]
    assert eos not in free.tokens[0][:2]
    streamer = Collect()
    out = engine.generate(w, get_policy("full"), [row], max_new_tokens=24, pad_token_id=PAD, eos_token_id=eos,
                          streamer=streamer, kernels="naive")
    assert out.finish == ["eos"] and out.tokens[0] == free.tokens[0][:3]
    assert streamer.ids == out.tokens[0]


def test_streamer_stops_at_a_stop_string_just_before_eos():
    """A stop string and an EOS inside the same check window: the answer and the stream both end after the
    stop string (the row was already finished by EOS when the host looked)."""
    tok = tiny_tokenizer()
    model = model_of("llama")
    row = prompts(seed=1)[1]
    w = Weights.from_model(model, positions=256)
    free = engine.generate(w, get_policy("full"), [row], max_new_tokens=24, pad_token_id=PAD, kernels="naive")
    eos, stop = free.tokens[0][4], tok.decode(free.tokens[0][1:3])
    assert eos not in free.tokens[0][:4] and stop not in tok.decode(free.tokens[0][:2])
    streamer = Collect()
    out = engine.generate(w, get_policy("full"), [row], max_new_tokens=24, pad_token_id=PAD, eos_token_id=eos,
                          stop_strings=[stop], tokenizer=tok, streamer=streamer, check_every=16, kernels="naive")
    assert out.finish == ["stop"] and out.tokens[0] == free.tokens[0][:3]
    assert streamer.ids == out.tokens[0]


# -- 5. the short-context fallback ---------------------------------------------------------------------------
def test_default_min_context_falls_back_to_full():
    assert default_min_context("delta", 1) == 32768
    assert default_min_context("delta", 7) == 32768 and default_min_context("delta", 8) == 8192
    assert default_min_context("lychee", 1) == 65536
    assert default_min_context("full", 1) == 0
    model = model_of("llama")
    ids, mask = left_padded(prompts())
    for x, m in ((ids[:1, :], None), (ids, mask)):
        full = run(model, "full", "static", x, m)
        with attach(model, manifest_of(model, "delta"), "delta", engine="static", **PARAMS["delta"]) as s:
            fallback = s.generate(input_ids=x, attention_mask=m, **WITH_LOGITS)
            assert s.last.info["min_context"] == 32768
            assert s.last.info["attended_fraction"] == 1.0
        sparse = run(model, "delta", "static", x, m)  # min_context=0
        assert torch.equal(fallback.sequences, full.sequences)
        assert all(torch.equal(a, b) for a, b in zip(fallback.logits, full.logits))
        steps = active_steps(full.sequences, x.shape[1], model.generation_config.eos_token_id)
        assert max_logit_gap(sparse.logits, full.logits, steps) > 1e-2


def test_min_context_switches_to_the_sparse_step_mid_generation():
    model = model_of("qwen3")
    x = torch.tensor([prompts()[0]])  # 90 tokens: steps at cache length < 95 run the full step
    full = run(model, "full", "static", x)
    mixed = run(model, "delta", "static", x, min_context=95)
    sparse = run(model, "delta", "static", x)
    switch = 95 - 90 + 1  # logits 0 (prefill) … 5 come from full steps, 6 (cache length 95) on from sparse ones
    assert all(torch.equal(a, b) for a, b in zip(mixed.logits[:switch], full.logits[:switch]))
    assert all(float((a - b).abs().max()) > 1e-3 for a, b in zip(mixed.logits[switch:], full.logits[switch:]))
    assert not all(torch.equal(a, b) for a, b in zip(mixed.logits, sparse.logits))


# -- 6. attach() restores the model --------------------------------------------------------------------------
@pytest.mark.parametrize("family,policy", [("llama", "full"), ("qwen3", "delta"), ("gemma3", "lychee")])
def test_attach_restores_the_model(family, policy):
    model = model_of(family)
    ids, mask = left_padded(prompts())
    before_impl = model.config._attn_implementation
    params = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    for kind in ("static", "reference"):
        with attach(model, manifest_of(model, policy), policy, engine=kind, min_context=0, **PARAMS[policy]) as s:
            s.generate(input_ids=ids, attention_mask=mask, **GREEDY)
            assert model.config._attn_implementation != before_impl  # rolecall's hook was in place
        assert model.config._attn_implementation == before_impl
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)
    manifest = manifest_of(model, policy)
    with pytest.raises(RuntimeError, match="boom"), attach(model, manifest, policy, engine="static",
                                                           **PARAMS[policy]) as s:
        s.generate(input_ids=ids, attention_mask=mask, **GREEDY)
        raise RuntimeError("boom")
    assert model.config._attn_implementation == before_impl
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


# -- 7. what the engine runs ---------------------------------------------------------------------------------
def test_unsupported_configs():
    for family in FAMILIES:
        assert unsupported(tiny_config(family)) is None, family
    cases = {
        "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=2),
        "MLP bias": LlamaConfig(mlp_bias=True),
        "relu": LlamaConfig(hidden_act="relu"),
        "dynamic": LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "quantized (bitsandbytes)": LlamaConfig(quantization_config={"quant_method": "bitsandbytes",
                                                                      "load_in_4bit": True}),
    }
    for word, config in cases.items():
        why = unsupported(config)
        assert isinstance(why, str) and why and "\n" not in why and word in why, (word, why)
    with pytest.raises(NotImplementedError, match="MLP bias"):
        engine.ModelShape.from_config(LlamaConfig(mlp_bias=True))


def test_a_model_spread_over_devices_or_offloaded_stays_off_the_engine():
    """The engine reads every weight on one device: a device map's spread or disk offload keeps a request on the
    transformers path (one line saying why), and taking such a model's weights is refused."""
    model = model_of("llama")
    assert placement_problem(model) is None
    spread = SimpleNamespace(parameters=lambda: [SimpleNamespace(device=torch.device(f"cuda:{i}")) for i in (1, 0, 1)])
    assert placement_problem(spread) == ("a device map spread the model over cuda:0, cuda:1; the engine runs a model "
                                         "on one device")
    ids, mask = left_padded(prompts())
    with torch.device("meta"):
        offloaded = torch.nn.Linear(4, 4)
    model.model.layers[1].mlp.down_proj = offloaded  # what accelerate leaves in a module offloaded to the disk
    why = placement_problem(model)
    assert why and "offloaded" in why
    with pytest.raises(ValueError, match="offloaded"):
        Weights.from_model(model)
    with attach(model, None, "full", engine="static") as s:
        assert s.engine_reason({"input_ids": ids}) == why
        with pytest.raises(PolicyError, match="offloaded"):
            s.generate(input_ids=ids, attention_mask=mask, **GREEDY)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("policy", ["delta", "delta-per-head", "lychee", "quest", "vattention-delta", "lethe"])
def test_a_model_spread_over_two_gpus_decodes_as_on_one(policy, capsys):
    """A device map puts layers 0-1 on one GPU and 2-3 on another, so the pages a Δ-layer picks and the sets a
    lychee head hands on cross to the other GPU: every policy gives the tokens it gives the model on one GPU."""
    from accelerate import dispatch_model

    model = model_of("llama")
    name = policy.split("-")[0]
    manifest = manifest_of(model, policy)
    ids, mask = left_padded(prompts())
    whole = copy.deepcopy(model).to("cuda:0")
    placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                 "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    spread = dispatch_model(model, device_map=placement)
    kwargs = dict(min_context=0, **PARAMS[policy])
    with attach(whole, manifest, name, engine="reference", **kwargs) as s:
        one = s.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), **GREEDY)
        read_one = s.summary()["attended_fraction"]
    current = []  # (the current GPU, the layer's GPU) at each decode step's plan: the kernels launch on the first
    with attach(spread, manifest, name, **kwargs) as s:
        assert s.engine_reason({"input_ids": ids}).startswith("a device map spread the model over cuda:0, cuda:1")
        plan = s.policy.plan
        s.policy.plan = lambda step: (current.append((torch.cuda.current_device(), step.key.device.index)),
                                      plan(step))[1]
        two = s.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), **GREEDY)
        read_two = s.summary()["attended_fraction"]
    assert "decoding on the transformers path (a device map spread the model" in capsys.readouterr().err
    assert torch.equal(one, two.to(one.device)) and 0 < read_two == read_one < 1
    assert {layer for _, layer in current} == {0, 1} and all(gpu == layer for gpu, layer in current)


def test_auto_runs_the_reference_path_on_cpu_and_static_the_engine():
    model = model_of("llama")
    ids, mask = left_padded(prompts())
    manifest = manifest_of(model, "delta")
    with attach(model, manifest, "delta", engine="auto", min_context=0, **PARAMS["delta"]) as s:
        assert s.engine_reason({}) == "the model is not on a CUDA device"
        auto = s.generate(input_ids=ids, attention_mask=mask, **GREEDY)
        assert s.last is None
        assert s.stats.steps[3] > 0  # the reference path called the policy's plan
    with attach(model, manifest, "delta", engine="static", min_context=0, **PARAMS["delta"]) as s:
        assert s.engine_reason({"input_ids": ids}) is None
        static = s.generate(input_ids=ids, attention_mask=mask, **GREEDY)
        assert isinstance(s.last, Generation) and s.last.finish and s.last.prompt_lengths == list(LENGTHS)
        assert s.stats.steps[3] == 0  # the engine does not go through the hook
        assert 0 < s.last.info["attended_fraction"] < 1
        with pytest.raises(PolicyError, match="beam"):
            s.generate(input_ids=ids, attention_mask=mask, num_beams=2, **GREEDY)
        with pytest.raises(PolicyError, match="repetition_penalty"):
            s.generate(input_ids=ids, attention_mask=mask, repetition_penalty=1.3, **GREEDY)
    assert torch.equal(auto, static)
    lychee = manifest_of(model, "lychee")
    with attach(model, lychee, "lychee", engine="static", ratio=0.5) as s, pytest.raises(PolicyError, match="ratio"):
        s.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    with attach(model, None, "vattention", engine="static") as s, pytest.raises(PolicyError, match="max_sample"):
        s.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    with attach(model, None, "vattention", engine="auto") as s:  # auto falls back instead
        s.generate(input_ids=ids, attention_mask=mask, **dict(GREEDY, max_new_tokens=2))
        assert s.last is None


# -- slow: the embedded real models ------------------------------------------------------------------------------
ENGLISH = ["The capital of France is", "Once upon a time, a little fox",
           "Photosynthesis is the process by which plants"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m"])
def test_embedded_model_engine_equals_generate(name):
    from rolecall.core.models import ModelNotFoundError, load_model, load_tokenizer

    try:
        model = load_model(name, dtype="float32")
        tok = load_tokenizer(name)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    assert unsupported(model.config) is None
    for text in ENGLISH:
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want = model.generate(input_ids=ids, do_sample=False, max_new_tokens=64)
        with attach(model, None, "full", engine="static") as s:
            got = s.generate(input_ids=ids, do_sample=False, max_new_tokens=64)
            assert isinstance(s.last, Generation)
        assert torch.equal(got, want), (text, tok.decode(got[0, ids.shape[1]:]), tok.decode(want[0, ids.shape[1]:]))
        assert math.isfinite(s.last.tokens_per_s)


@pytest.mark.slow
def test_gemma3_engine_equals_generate_past_its_window():
    """Gemma-3-270M's sliding layers hold rings of 513 slots on the engine: a prompt of 700 tokens of an essay
    wraps them in the prefill, and 64 greedy tokens move them on; the tokens equal ``model.generate``'s (float32),
    as does a ragged batch of that prompt beside a short one."""
    from rolecall.core.models import ModelNotFoundError, load_model, load_tokenizer
    from rolecall.data.corpora import CorpusNotFoundError, load_corpus

    try:
        model = load_model("gemma3-270m", dtype="float32")
        tok = load_tokenizer("gemma3-270m")
        essay = next(iter(load_corpus("pg-essays"))).text
    except (ModelNotFoundError, CorpusNotFoundError) as e:
        pytest.skip(str(e))
    assert model.config.sliding_window == 512
    long = tok(essay, return_tensors="pt")["input_ids"][:, :700]
    short = tok(ENGLISH[0], return_tensors="pt")["input_ids"]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ragged = torch.full((2, 700), pad, dtype=long.dtype)
    ragged[0], ragged[1, 700 - short.shape[1]:] = long[0], short[0]
    mask = (torch.arange(700)[None, :] >= torch.tensor([[0], [700 - short.shape[1]]])).long()
    for ids, attention in ((long, None), (ragged, mask)):
        kw = dict(input_ids=ids, attention_mask=attention, do_sample=False, max_new_tokens=64, pad_token_id=pad)
        with torch.no_grad():
            want = model.generate(**kw)
        with attach(model, None, "full", engine="static") as s:
            got = s.generate(**kw)
            assert isinstance(s.last, Generation)
        assert torch.equal(got, want), (tok.decode(got[0, 700:]), tok.decode(want[0, 700:]))


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_long_chunks_mlp_runs_in_parts_with_the_same_result(family, monkeypatch):
    """A prefill chunk's output projection and MLP run over at most ``MLP_TOKENS`` tokens at once (rows × positions;
    a ragged batch, Gemma 3's sandwich norms): the logits and every layer's cache equal those of one pass."""
    from rolecall.runtime.engine import StaticDecoder, pad_left
    from rolecall.runtime.engine import layers as L

    model = model_of(family)
    ids, pads = pad_left(prompts(), PAD)
    w = Weights.from_model(model, positions=256)

    def prefill():
        dec = StaticDecoder(w, get_policy("full"), batch=ids.shape[0], max_len=128, kernels="naive")
        return dec.prefill(ids, pads).clone(), [t.clone() for t in dec.cache.k + dec.cache.v]

    whole, whole_cache = prefill()
    calls = []
    finish = L.finish_tensors
    monkeypatch.setattr(L, "finish_tensors", lambda s, x, attn, **kw: calls.append(x.shape[0]) or finish(s, x, attn, **kw))
    monkeypatch.setattr(L, "MLP_TOKENS", 50)  # rows of [B · C, H]: parts cross from one prompt into the next
    parts, parts_cache = prefill()
    layers = model.config.num_hidden_layers
    n = ids.numel()
    assert n > 100 and n % 50 and calls == ([50] * (n // 50) + [n % 50]) * layers
    assert float((parts - whole).abs().max()) < 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(parts_cache, whole_cache)) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_stays_causal_and_equals_one_forward(family, monkeypatch):
    """An unpadded prompt in chunks: each chunk after the first reads the keys before it through SDPA's causal
    kernel aligned to the lower right (no boolean mask on layers without a window), and the last position's
    logits and every cached key equal one transformers forward over the whole prompt."""
    import types

    import torch.nn.functional as F
    from torch.nn.attention.bias import CausalBias

    from rolecall.runtime.engine import StaticDecoder
    from rolecall.runtime.engine import prefill as prefill_module

    model = model_of(family)
    rows = prompts(lengths=(90, 90), seed=3)
    ids = torch.tensor(rows)
    kinds, reads = [], []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        kinds.append("causal" if is_causal else type(attn_mask).__name__ if isinstance(attn_mask, CausalBias)
                     else "mask")
        reads.append(k.shape[2])
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(prefill_module, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    dec = StaticDecoder(Weights.from_model(model, positions=128), get_policy("full"), batch=2, max_len=96,
                        kernels="naive")
    logits = dec.prefill(ids, chunk=32).clone()  # chunks of 32, 32, 26 tokens
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert float((logits - out.logits[:, -1]).abs().max()) < 1e-4, family
    layers = model.config.num_hidden_layers
    dense = [i for i in range(layers) if dec.shape.windows[i] is None]  # Mistral: a window on every layer
    assert bool(dense) == (family != "mistral"), family
    assert kinds == ["causal" if i in dense else "mask" for i in range(layers)] + \
        ["CausalBias" if i in dense else "mask" for i in range(layers)] * 2, (family, kinds)
    # a sliding layer reads only what its window reaches (Gemma 3's tiny window: 8; Mistral's 4,096 covers all)
    want = [end if dec.shape.windows[i] is None else end - max(0, start - dec.shape.windows[i] + 1)
            for start, end in ((0, 32), (32, 64), (64, 90)) for i in range(layers)]
    assert reads == want, (family, reads)
    for i in range(layers):
        k = out.past_key_values.layers[i].keys[:, :, -90:]  # a sliding layer's cache holds its window
        n = k.shape[2]
        held = dec.cache.read_ring(i, 90 - n, 90)[0] if i in dec.cache.rings else dec.cache.k[i][:, :, 90 - n:90]
        assert float((held - k).abs().max()) < 1e-4, (family, i)
    # Gemma 3's sliding layers hold rings of window + 1 slots; the other layers (and Mistral's) every slot
    assert {i: t.shape[2] for i, t in enumerate(dec.cache.k)} == \
        {i: 9 if i in dec.cache.rings else 96 for i in range(layers)}, family
    assert sorted(dec.cache.rings) == ([] if family == "mistral" else [i for i in range(layers) if i not in dense])


@pytest.mark.parametrize("ragged", [False, True])
def test_sliding_layers_prefill_in_blocks_that_read_only_their_window(ragged, monkeypatch):
    """A sliding-window layer attends in blocks of queries, each reading only the keys its window reaches (the
    block and the window − 1 slots before it): the cache and the logits equal a prefill in one block per chunk
    (and, unpadded, one transformers forward), padded rows included."""
    import types

    import torch.nn.functional as F

    from rolecall.runtime.engine import StaticDecoder, pad_left
    from rolecall.runtime.engine import prefill as prefill_module

    model = model_of("gemma3")  # window 8 on the sliding layers
    rows = prompts(lengths=(90, 61, 77) if ragged else (90, 90), seed=4)
    ids, pads = pad_left(rows, PAD)
    w = Weights.from_model(model, positions=128)
    window = w.shape.windows[0]
    assert window == 8 and None in w.shape.windows
    reads, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        reads.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    def run(block: int):
        monkeypatch.setattr(prefill_module, "WINDOW_BLOCK", block)
        dec = StaticDecoder(w, get_policy("full"), batch=len(rows), max_len=96, kernels="naive")
        return dec, dec.prefill(ids, pads, chunk=32).clone()

    one, want = run(10_000)  # one block per chunk: every query of a chunk reads the chunk and its window
    monkeypatch.setattr(prefill_module, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    blocked, got = run(window)
    assert float((got - want).abs().max()) < 1e-4  # float32 rounding: the blocks sum in another order
    for i in range(len(w.layers)):
        assert float((blocked.cache.k[i][:, :, :90] - one.cache.k[i][:, :, :90]).abs().max()) < 1e-4, i
    windowed = [(q, k) for q, k in reads if k < 90 and q <= window]  # the sliding layers' calls
    assert windowed and all(k <= q + window - 1 for q, k in windowed), reads
    if not ragged:
        with torch.no_grad():
            out = model(ids, use_cache=False)
        assert float((got - out.logits[:, -1]).abs().max()) < 1e-4


def test_prefill_chunk_grows_when_few_rows():
    from rolecall.runtime.engine.prefill import chunk_for

    assert [chunk_for(b) for b in (1, 2, 8, 32)] == [32768, 16384, 4096, 4096]
    assert chunk_for(1, padded=True) == chunk_for(2, padded=True) == 4096  # a padded batch reads a mask


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_kept_prefill_serves_every_policy(family):
    """One prefill kept (``keep_prefill``) and loaded by decoders of other policies (``prefilled``), whatever
    order their caches keep the KV heads in (lychee puts retrieval heads first) or however they size their layers
    (lethe's compact ones), generates what each policy generates from its own prefill; other prompts are
    refused before any work."""
    model = model_of(family)
    rows = prompts()
    w = Weights.from_model(model, positions=256)
    bound = {}
    for policy in ("full", "lychee", "lethe", "quest", "delta"):
        pol = get_policy(policy, **PARAMS[policy])
        pol.bind(manifest_of(model, policy), model.config)
        bound[policy] = pol
    common = dict(max_new_tokens=NEW, pad_token_id=PAD, kernels="naive", output_logits=True, min_context=0)
    kept = traced_generate(w, bound["full"], rows, keep_prefill=True, **common).prefilled
    dense = w.shape.windows.index(None)  # a layer without a window holds the prompt; a sliding one its ring
    assert kept is not None and kept.k[dense].shape[2] == max(LENGTHS)
    for policy, pol in bound.items():
        own = engine.generate(w, pol, rows, **common)
        shared = traced_generate(w, pol, rows, prefilled=kept, **common)
        assert shared.tokens == own.tokens, (family, policy)
        gap = max(float((a - b).abs().max()) for a, b in zip(shared.logits, own.logits))
        assert gap < 1e-4, (family, policy, gap)
        assert shared.prefilled is None  # kept only when asked
    with pytest.raises(ValueError, match="other prompts"):
        traced_generate(w, bound["delta"], [r[1:] for r in rows], prefilled=kept, **common)


def test_a_ring_shorter_than_the_window_holds_a_short_request_and_a_kept_prefill_fits_any_ring():
    """A cache shorter than a sliding layer's window holds a ring of its own length (no more slots than the request
    needs) and never wraps; a kept prefill carries a ring's last min(prompt, window) tokens in slot order, so it loads
    into a decoder whose ring is of another length and generates what that decoder generates from its own prefill."""
    model = tiny_model("gemma3", layers=6, heads=4, kv_heads=2, head_dim=16, sliding_window=48)
    w = Weights.from_model(model, positions=256)
    rows = prompts(lengths=(30, 22, 36), seed=4)
    common = dict(pad_token_id=PAD, kernels="naive", output_logits=True, min_context=0)
    short = traced_generate(w, get_policy("full"), rows, max_new_tokens=6, keep_prefill=True, **common)
    sliding = model.config.layer_types.count("sliding_attention")
    assert short.info["cache_slots"] == 42 and 0 < sliding < 6
    # K and V in float32, 3 rows × 2 KV heads × 16: every layer 42 slots, a ring its 42 tokens and the padding's slot
    assert short.info["cache_bytes"] == 2 * 4 * 3 * 2 * 16 * (42 * 6 + sliding)
    long_ = engine.generate(w, get_policy("full"), rows, max_new_tokens=40, **common)  # 76 slots: rings of 48
    loaded = traced_generate(w, get_policy("full"), rows, max_new_tokens=40, prefilled=short.prefilled,
                             **common)
    assert loaded.tokens == long_.tokens
    assert max(float((a - b).abs().max()) for a, b in zip(loaded.logits, long_.logits)) < 1e-5
    with torch.no_grad():  # and both equal transformers past the window (76 > 48 positions for the longest row)
        ids = torch.tensor([rows[2] + long_.tokens[2][:-1]])
        want = model(ids).logits[0, len(rows[2]) - 1:]
    assert float((long_.logits[2][:want.shape[0]] - want).abs().max()) < 1e-4


def test_lychee_keeps_the_sessions_weights_while_its_cache_reorders_heads():
    """Lychee's cache stores each layer's retrieval heads first; the decoder reads and writes heads through that
    order, so it holds the session's tensors themselves (no copy in its order) and its cache is in that order."""
    model = model_of("llama")
    w = Weights.from_model(model, positions=256)
    pol = get_policy("lychee", **PARAMS["lychee"])
    pol.bind(manifest_of(model, "lychee"), model.config)  # retrieval heads [1, 1], [0, 1], [0, 0], [1, 0]
    dec = engine.StaticDecoder(w, pol, 1, 64, kernels="naive")
    assert dec.weights is w
    assert [m is not None for m in dec.head_maps] == [False, True, False, False]
    assert dec.head_maps[1].tolist() == [1, 0]
    assert dec.cache.head_order is not None and dec.cache.head_order[1].tolist() == [1, 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_kept_decoder_serves_the_next_requests_as_a_new_one(policy):
    """Requests of one kind run on the decoder ``Decoders`` kept from the first (reset: cache, length, padding,
    the policy's page bounds, the stopper's and sampler's books) and give what a new decoder of the same size
    gives, to the last logit's bits, after longer and shorter prompts, per-row limits and sampling; another kind
    (sampling) builds its own. Lethe's decoders shrink when they settle, so none is kept."""
    model = model_of("gemma3" if policy == "lychee" else "llama")
    w = Weights.from_model(model, positions=1024)
    pol = get_policy(policy.split("-")[0], **PARAMS[policy])
    pol.bind(manifest_of(model, policy), model.config)
    kept = engine.Decoders()
    greedy, sampled = Sampling(), Sampling(True, 0.9, 20, 0.95, seed=5)
    requests = [((120, 70, 81), 20, greedy), ((40, 66, 52), 12, greedy), ((100, 30, 95), [5, 20, 9], greedy),
                ((50, 60, 70), 16, sampled), ((90, 40, 20), 16, sampled)]
    seen = []
    for i, (lengths, new, sampling) in enumerate(requests):
        rows = prompts(lengths, seed=i)
        common = dict(max_new_tokens=new, sampling=sampling, pad_token_id=PAD, kernels="naive", min_context=0)
        fresh = engine.Decoders()
        got = engine.generate(w, pol, rows, decoders=kept, **common)
        want = engine.generate(w, pol, rows, decoders=fresh, **common)
        assert (got.tokens, got.finish) == (want.tokens, want.finish), (policy, i)
        assert got.info["cache_slots"] == want.info["cache_slots"] == MIN_SLOTS
        seen.append(kept.kept)
        if seen[-1] is not None:
            assert torch.equal(seen[-1].logits, fresh.kept.logits), (policy, i)
    if policy == "lethe":
        assert seen == [None] * len(requests)
        return
    assert all(d is seen[0] for d in seen[:3]) and seen[3] is not seen[0] and seen[4] is seen[3]
    plain = engine.generate(w, pol, prompts(requests[1][0], seed=1), max_new_tokens=12, pad_token_id=PAD,
                            kernels="naive", min_context=0)
    assert plain.info["cache_slots"] == max(requests[1][0]) + 12  # without Decoders: sized to the request


def test_kept_decoders_round_their_slots_and_serve_requests_that_fill_half():
    assert [engine.Decoders.slots_for(n, 10**6) for n in (1, 102, 256, 257, 300, 1000, 1025, 5000)] == \
        [256, 256, 256, 320, 320, 1024, 1280, 5120]
    assert engine.Decoders.slots_for(3000, 2048) == 3000 and engine.Decoders.slots_for(1000, 1100) == 1024
    model = model_of("llama")
    w = Weights.from_model(model, positions=4096)
    kept = engine.Decoders()
    common = dict(max_new_tokens=4, pad_token_id=PAD, kernels="naive")
    sizes = []
    for n in (500, 300, 700, 200, 700):  # 504 → 512; 304 fits; 704 → 768; 204 is under half of 768; 704 → 768
        engine.generate(w, None, [[i % 256 for i in range(n)]], decoders=kept, **common)
        sizes.append((kept.kept.max_len, kept.kept))
    assert [s for s, _ in sizes] == [512, 512, 768, 256, 768]
    assert sizes[0][1] is sizes[1][1] and len({id(d) for _, d in sizes[1:]}) == 4  # all held here: no id reused


def test_short_prompts_are_padded_to_a_graph_width():
    """The prefill graph's widths: the smallest that holds the longest prompt, none past 1,024 tokens or 4,096
    rows × width; pad_left pads to a given width and refuses a shorter one."""
    from rolecall.runtime.engine.prefill import graph_width

    assert [graph_width(n, 1) for n in (1, 16, 17, 25, 49, 100, 700, 1024, 1025)] == \
        [16, 16, 24, 32, 64, 128, 768, 1024, None]
    assert graph_width(60, 64) == 64 and graph_width(65, 64) is None and graph_width(200, 16) == 256
    ids, pads = engine.pad_left([[5, 6], [7]], 0, width=4)
    assert ids.tolist() == [[0, 0, 5, 6], [0, 0, 0, 7]] and pads == [2, 3]
    with pytest.raises(ValueError, match="width 1 is shorter than the longest row"):
        engine.pad_left([[5, 6]], 0, width=1)


def test_a_session_keeps_its_decoder_between_requests_and_frees_it_at_the_end():
    """Two requests in one session run on one decoder and give what a session each gives; a request for every
    step's logits frees it (its own decoder is sized to it and not kept); the end of the session frees it."""
    model = model_of("qwen3")
    manifest = manifest_of(model, "delta")
    requests = [prompts((90, 70, 81), seed=3), prompts((60, 88, 40), seed=4)]
    alone = []
    for rows in requests:
        with attach(model, manifest, "delta", engine="static", min_context=0, **PARAMS["delta"]) as s:
            alone.append(s.generate(input_ids=left_padded(rows)[0], attention_mask=left_padded(rows)[1], **GREEDY))
    with attach(model, manifest, "delta", engine="static", min_context=0, **PARAMS["delta"]) as s:
        together, decoders = [], []
        for rows in requests:
            ids, mask = left_padded(rows)
            together.append(s.generate(input_ids=ids, attention_mask=mask, **GREEDY))
            decoders.append(s._decoders.kept)
        assert decoders[0] is decoders[1] is not None
        s.generate(input_ids=ids, attention_mask=mask, **WITH_LOGITS)  # buffers sized to the request: not kept
        assert s._decoders.kept is None and isinstance(s.last, Generation)
        s.generate(input_ids=ids, attention_mask=mask, **GREEDY)
        assert s._decoders.kept is not None
    assert s._decoders.kept is None
    for a, b in zip(alone, together):
        assert torch.equal(a, b)


def test_a_session_views_the_models_projections_and_gives_them_back(tmp_path):
    """Inside a session the model's q/k/v and gate/up projections are views of the engine's stacked matrices: the
    engine holds no second copy of any projection, and the model's storages hold the bytes they held. More
    positions extend the RoPE tables only. At the end the model has standalone tensors of the same values (it
    saves and loads as before), the session's weights are spent, and a later session takes them again."""
    model = model_of("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def storages(tensors) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    held = sum(storages(model.parameters()).values())
    kw = dict(input_ids=torch.tensor([prompts(seed=2)[0]]), max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    with attach(model, None, "full", engine="static") as s:
        want = s.generate(**kw)
        w = s.engine_weights
        ours = storages(model.parameters())
        assert sum(ours.values()) == held
        projections = [t for lw in w.layers for t in (lw.wqkv, lw.w_gate_up, lw.wo, lw.w_down)]
        assert set(storages(projections)) <= set(ours)  # no projection copied
        first = model.model.layers[0]
        assert first.self_attn.k_proj.weight.untyped_storage().data_ptr() == w.layers[0].wqkv.data_ptr()
        assert torch.equal(first.mlp.up_proj.weight, w.layers[0].w_gate_up[model.config.intermediate_size:])
        longer = w.with_positions(model, 2 * w.max_positions)
        assert longer.max_positions == 2 * w.max_positions and longer.layers[1].wqkv is w.layers[1].wqkv
    assert not w.layers and not w.taken_from(model)
    for p in model.parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()  # standalone again
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.save_pretrained(tmp_path / "saved")  # safetensors refuses tensors that share storage
    again = type(model).from_pretrained(tmp_path / "saved")
    assert all(torch.equal(v, before[k]) for k, v in again.state_dict().items())
    with attach(model, None, "full", engine="static") as s:
        assert torch.equal(s.generate(**kw), want) and s.engine_weights is not w
    with pytest.raises(RuntimeError, match="boom"), attach(model, None, "full", engine="static") as s:
        s.generate(**kw)
        raise RuntimeError("boom")
    assert not s.engine_weights.layers  # given back on the way out of a block that raised too
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    model.to(torch.float64)
    with attach(model, None, "full", engine="static") as s:
        s.generate(**kw)
        assert s.engine_weights.dtype == torch.float64


def test_row_sampler_modes_follow_the_rows_that_sample():
    """Greedy mode while no row samples (an argmax, nothing else), sample mode while one does: its row draws what a
    lone Sampler draws with the same settings, the greedy rows still take their argmax; freeing the row goes back."""
    from rolecall.runtime.engine.sampling import RowSampler, Sampling

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = RowSampler(3, "cpu")
    assert rows.mode == "greedy" and rows.modes == ("greedy", "sample")
    assert torch.equal(rows(logits), logits.argmax(-1))
    assert rows.step.tolist() == [0, 0, 0]  # greedy mode draws nothing
    sampling = Sampling(do_sample=True, temperature=0.7, top_k=10, top_p=0.9, seed=5)
    rows.set_row(1, sampling, 0)
    assert rows.mode == "sample"
    alone = Sampler(sampling, "cpu")
    for _ in range(3):
        got = rows(logits)
        assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()
        assert got[1] == alone(logits[1:2])[0]
    rows.set_row(2, Sampling(), 0)  # a greedy request in another row leaves the mode alone
    assert rows.mode == "sample"
    rows.free_row(1)
    assert rows.mode == "greedy"
    rows.set_row(1, sampling, 0)
    rows.set_row(1, Sampling(), 0)  # the row's next request is greedy
    assert rows.mode == "greedy"
