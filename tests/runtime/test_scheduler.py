"""Continuous batching: interleaved requests get the tokens each gets alone, rows are reused cleanly, bad requests
are refused before any work and the scheduler keeps serving."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from rolecall.runtime.engine import Sampling, Weights, generate
from rolecall.runtime.engine.scheduler import Request, RequestError, Scheduler, SchedulerClosed
from rolecall.runtime.session import bound_policy
from tests.runtime.test_engine import PARAMS, manifest_of, model_of
from tests.tiny import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

SERVED = ["full", "delta", "delta-per-head", "delta-refine", "lychee", "quest", "vattention", "vattention-delta", "lethe"]


class Collector:
    """Each request's events, and a way to wait for all of them to finish."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.finish: dict[int, str] = {}
        self.events: dict[int, int] = {}
        self._done = threading.Semaphore(0)

    def emit(self, key: int):
        self.tokens[key], self.text[key], self.events[key] = [], "", 0

        def on(event) -> None:
            self.tokens[key] += event.token_ids
            self.text[key] += event.text
            self.events[key] += 1
            if event.finish_reason is not None:
                self.finish[key] = event.finish_reason
                self._done.release()
        return on

    def wait(self, n: int, timeout: float = 120.0) -> None:
        for _ in range(n):
            assert self._done.acquire(timeout=timeout), "a request did not finish"


def serve_all(weights, pol, requests, **scheduler) -> tuple[Collector, Scheduler]:
    """Every request submitted at once to a scheduler made with ``scheduler``'s arguments, all waited for."""
    got = Collector()
    with Scheduler(weights, pol, **scheduler) as sched:
        for i, r in enumerate(requests):
            sched.submit(r, got.emit(i))
        got.wait(len(requests))
    return got, sched


def served(policy: str, family: str = "llama"):
    model = model_of(family)
    name = policy.split("-")[0]
    params = dict(PARAMS[policy])
    bound = bound_policy(name, manifest_of(model, policy), model.config, **params)
    return model, Weights.from_model(model, positions=512), bound


def random_requests(seed: int, count: int, vocab: int = 256) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(vocab) for _ in range(rng.randint(1, 120))], max_new_tokens=rng.randint(1, 24),
                    ignore_eos=True) for _ in range(count)]


@pytest.mark.parametrize("policy", SERVED)
def test_interleaved_requests_get_the_tokens_each_gets_alone(policy):
    """Ten requests of random lengths through three rows (rows reused, requests joining while others decode)
    give, greedy, the very tokens of each decoded alone on the engine; a sampled one those of its seed alone."""
    model, weights, pol = served(policy)
    requests = random_requests(1, 10)
    requests[4] = Request(requests[4].prompt, 20, Sampling(True, 0.8, 20, 0.9, seed=7), ignore_eos=True)
    got = serve_all(weights, pol, requests, slots=3, check_every=3, min_context=0)[0]
    for i, r in enumerate(requests):
        alone = generate(weights, pol, [list(r.prompt)], max_new_tokens=r.max_new_tokens, sampling=r.sampling,
                         min_context=0).tokens[0]
        assert got.tokens[i] == alone, (policy, i)
        assert got.finish[i] == "length"


def test_a_reused_row_does_not_see_the_previous_request():
    """A long request, then a short one in the same (only) row: the short one equals itself alone, and so does
    the long one run again after it."""
    model, weights, pol = served("delta")
    long, short = random_requests(3, 2)
    long = Request([5] * 150, 30, ignore_eos=True)
    got, sched = serve_all(weights, pol, (long, short, long), slots=1, check_every=4, min_context=0)
    for i, r in enumerate((long, short, long)):
        alone = generate(weights, pol, [list(r.prompt)], max_new_tokens=r.max_new_tokens, min_context=0).tokens[0]
        assert got.tokens[i] == alone, i
    cache = sched.engine.dec.cache  # the freed row reads one slot, not the last request's context
    assert cache.length.tolist() == [0] and cache.pads.tolist() == [0]



@pytest.mark.parametrize("policy", ["delta", "lychee"])
def test_below_min_context_the_rows_take_the_full_step(policy):
    """A sparse policy's scheduler runs the full step while its longest live request is below ``min_context``
    (default: the measured crossover at its slot count) and its own step from there: one request alone in the
    scheduler gets the tokens the engine gives it alone with the same ``min_context``, which differ from the
    always-sparse ones; far above every length, the full policy's tokens."""
    from rolecall.runtime.engine import default_min_context

    model, weights, pol = served(policy)
    full = served("full")[2]
    request = Request([(7 * i) % 200 + 3 for i in range(100)], 40, ignore_eos=True)

    def served_alone(min_context):
        got, sched = serve_all(weights, pol, [request], slots=1, check_every=4, min_context=min_context)
        return got.tokens[0], sched.min_context

    def engine_alone(policy, min_context):
        return generate(weights, policy, [list(request.prompt)], max_new_tokens=40, min_context=min_context).tokens[0]

    switched, _ = served_alone(120)  # full for the first 20 tokens, then the policy's step
    assert switched == engine_alone(pol, 120)
    assert served_alone(10_000)[0] == engine_alone(full, 0)
    assert engine_alone(pol, 0) != engine_alone(full, 0)  # the policy's own tokens differ: the switch is seen
    assert served_alone(None)[1] == default_min_context(pol, 1) > 0
    with pytest.raises(ValueError, match="min_context must be an integer ≥ 0, got -1"):
        Scheduler(weights, pol, min_context=-1)

def test_eos_stop_strings_and_cancellation_end_a_request_and_free_its_row():
    model, weights, pol = served("full")
    tok = tiny_tokenizer()
    prompt = list(range(40, 90))
    alone = generate(weights, pol, [prompt], max_new_tokens=24, min_context=0).tokens[0]
    stop = tok.decode(alone[5:7])
    want = generate(weights, pol, [prompt], max_new_tokens=24, min_context=0, stop_strings=[stop],
                    tokenizer=tok).tokens[0]
    got = Collector()
    with Scheduler(weights, pol, slots=2, tokenizer=tok, eos_token_id=[alone[3]], check_every=4) as sched:
        sched.submit(Request(prompt, 24), got.emit(0))  # ends at its EOS (the 4th token)
        sched.submit(Request(prompt, 24, stop=(stop,), ignore_eos=True), got.emit(1))
        got.wait(2)
        assert got.tokens[0] == alone[:4] and got.finish[0] == "stop"
        assert got.tokens[1] == want and got.finish[1] == "stop" and got.text[1] == tok.decode(want)
        slow = sched.submit(Request(prompt, 400, ignore_eos=True), got.emit(2))
        sched.cancel(slow)
        got.wait(1)
        assert got.finish[2] == "cancelled" and len(got.tokens[2]) < 400
        assert sched.stats()["running"] == 0 and sched.stats()["slots_in_use"] == 0
        assert sched.stats()["kv_pages_used"] == 0  # a cancelled request's pages are no longer counted
        assert sched.stats()["kv_pages_total"] == 2 * -(-sched.max_context // 16)


@pytest.mark.parametrize("request_, field, says", [
    (Request([]), "prompt", "empty"),
    (Request([1, 2, 999_999]), "prompt", "the prompt has token id 999999, the model.s vocabulary has 260 ids"),
    (Request([1] * 500, 20), "prompt", "more than this server's context of 512"),
    (Request([1, 2], 0), "max_tokens", "≥ 1"),
    (Request([1, 2], 4, stop=("x",)), "stop", "tokenizer"),
])
def test_a_bad_request_is_refused_before_any_work_and_the_next_is_served(request_, field, says):
    model, weights, pol = served("full")
    got = Collector()
    with Scheduler(weights, pol, slots=2, max_context=512) as sched:
        with pytest.raises(RequestError, match=says) as err:
            sched.submit(request_, got.emit(0))
        assert err.value.field == field and "\n" not in str(err.value)
        assert 0 not in got.finish and sched.stats()["waiting"] == 0
        sched.submit(Request([3, 4, 5], 5, ignore_eos=True), got.emit(1))
        got.wait(1)
        assert len(got.tokens[1]) == 5


def test_drain_finishes_what_runs_and_refuses_what_comes():
    model, weights, pol = served("full")
    got = Collector()
    sched = Scheduler(weights, pol, slots=2)
    sched.submit(Request([3] * 30, 40, ignore_eos=True), got.emit(0))
    assert sched.drain(timeout=120)
    assert got.finish[0] == "length" and len(got.tokens[0]) == 40
    with pytest.raises(SchedulerClosed):
        sched.submit(Request([3], 2), got.emit(1))


def test_a_policy_whose_step_assumes_one_length_is_refused_in_one_line():
    """A step that does not declare ``row_lengths`` (state kept over one length for all rows) is refused when the
    scheduler is built, in one line."""
    from rolecall.runtime.policies.full import Full, FullStep

    class OneLength(FullStep):
        row_lengths = False

    class Once(Full):
        name = "once"

        def static_step(self, shape):
            return OneLength()

    model, weights, _ = served("full")
    with pytest.raises(NotImplementedError, match="policy 'once' cannot serve yet: its engine step keeps state that "
                                                  "assumes one length for all rows") as err:
        Scheduler(weights, Once())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("policy", ["full", "delta", "lychee", "quest", "vattention"])
def test_rows_of_their_own_lengths_in_the_triton_kernels(policy, monkeypatch):
    """The GPU kernels (in Triton's interpreter) read each row up to its own length, the dense calls in programs of
    ``ROWS_CHUNK`` tokens (64 here, so rows span several programs and a short row's later ones read nothing):
    interleaved requests through them give the tokens the reference kernels give each request alone."""
    import os

    import rolecall.runtime.engine.attention as attention

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    monkeypatch.setattr(attention, "ROWS_CHUNK", 64)
    model, weights, pol = served(policy)
    requests = random_requests(5, 4)
    lengths = [len(r.prompt) + r.max_new_tokens for r in requests]
    assert min(lengths) < 64 < max(lengths)  # one row spans two programs, another leaves its second empty
    got, sched = serve_all(weights, pol, requests, slots=2, check_every=2, kernels="triton", min_context=0)
    assert sched.engine.dec.attn._dense["chunk"] == 64
    for i, r in enumerate(requests):
        alone = generate(weights, pol, [list(r.prompt)], max_new_tokens=r.max_new_tokens, min_context=0,
                         kernels="naive").tokens[0]
        assert got.tokens[i] == alone, i


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "delta"])
def test_the_embedded_model_serves_interleaved_requests_as_alone_on_gpu(policy):
    """SmolLM2-135M in float32 on the GPU (Triton kernels, the step captured once): twelve requests of random
    lengths through four rows give each request's greedy tokens alone."""
    import os
    from pathlib import Path

    from rolecall.core.manifest import RoleManifest
    from rolecall.core.models import load_model

    name = os.environ.get("ROLECALL_TEST_MODEL", "smollm2-135m")
    model = load_model(name, dtype=torch.float32).to("cuda")
    manifest = None
    if policy == "delta":
        manifest = RoleManifest.load(Path(__file__).parents[2] / "artifacts" / "smollm2-135m" / "smollm2-135m.delta.safetensors")
    pol = bound_policy(policy, manifest, model.config, **({"budget": 256} if policy == "delta" else {}))
    weights = Weights.from_model(model, positions=4096)
    rng = random.Random(9)  # prompts of distinct random tokens: no repeated text whose pages score alike
    requests = [Request([rng.randrange(100, 40000) for _ in range(rng.randint(8, 960))], rng.randint(2, 48),
                        ignore_eos=True) for _ in range(12)]
    got = serve_all(weights, pol, requests, slots=4, max_context=4096, min_context=0)[0]
    for i, r in enumerate(requests):
        alone = generate(weights, pol, [list(r.prompt)], max_new_tokens=r.max_new_tokens, min_context=0,
                         output_logits=True)
        assert_same_up_to_a_tie(got.tokens[i], alone, i, **({"rank": 5, "gap": 1.0} if policy == "delta" else {}))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["full", "delta", "lychee", "quest", "delta-refine", "vattention",
                                    "vattention-delta", "lethe"])
def test_policies_with_per_row_state_serve_as_alone_on_gpu(policy):
    """The tiny model on the GPU (Triton kernels, CUDA graphs): the policies whose step keeps per-row state (page
    bounds, draws keyed by a row's length) give each of ten interleaved requests the tokens it gets when it runs
    alone through a scheduler of as many rows (the same kernels' launches, so a near-tie rounds alike): a row that
    read another row's or an old request's state would differ."""
    model, _, pol = served(policy)
    weights = Weights.from_model(model.to("cuda"), positions=512)
    requests = random_requests(11, 10)
    got = serve_all(weights, pol, requests, slots=3, check_every=3, min_context=0)[0]
    alone = Collector()
    with Scheduler(weights, pol, slots=3, check_every=3, min_context=0) as sched:
        for i, r in enumerate(requests):
            sched.submit(r, alone.emit(i))
            alone.wait(1)
    for i in range(len(requests)):
        assert got.tokens[i] == alone.tokens[i], (policy, i)


def assert_same_up_to_a_tie(tokens: list[int], alone, i: int, rank: int = 2, gap: float = 5e-3) -> None:
    """``tokens`` are ``alone``'s greedy tokens, or part from them once, at a step where ``tokens`` took one of
    alone's ``rank`` best tokens whose logit lies within ``gap`` of the best. On the GPU the kernels' launch (the
    projections' tiles, attention's splits) depends on the batch's row count, so a float sum may round the other
    way: full attention can then flip a near-tie; DELTA can also flip a near-tie among page scores (pages of random
    tokens score alike), which moves the next logits further. A row that read another row's or an old request's
    keys would differ at once and by far more."""
    want = alone.tokens[0]
    if tokens == want:
        return
    k = next((j for j, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
    assert k < min(len(tokens), len(want)), (i, "lengths differ", len(tokens), len(want))
    logits = alone.logits[0][k].float()
    behind = (logits.max() - logits[tokens[k]]).item()
    assert tokens[k] in logits.topk(rank).indices.tolist()[1:] and behind < gap, (i, k, tokens[k], want[k], behind)


def test_a_request_that_ignores_eos_ends_for_length_even_on_an_eos_token():
    """``ignore_eos`` runs a request to ``max_new_tokens``: when its last token happens to be an EOS id it still
    ended at its limit, so its finish reason is "length"; the same request heeding EOS stops at that id's first
    appearance, for "stop". The EOS id is the request's own 6th greedy token."""
    model, weights, pol = served("full")
    prompt = list(range(40, 90))
    alone = generate(weights, pol, [prompt], max_new_tokens=6, min_context=0).tokens[0]
    eos = alone[5]
    first = alone.index(eos) + 1
    got = serve_all(weights, pol, [Request(prompt, 6, ignore_eos=True), Request(prompt, 6)], slots=2,
                    eos_token_id=eos, min_context=0)[0]
    assert got.tokens[0] == alone and got.finish[0] == "length"
    assert got.tokens[1] == alone[:first] and got.finish[1] == "stop"


def test_tokens_per_second_counts_the_tokens_made_after_the_first_call_of_the_window():
    """Engine calls ending at 10 s, 11 s and 12 s with 5, 3 and 4 tokens: the window is 10 s → 12 s, and the
    5 tokens of the call that ended at its start were made before it, so the rate is (3 + 4) / 2 = 3.5 tokens/s."""
    from collections import deque

    model, weights, pol = served("full")
    sched = Scheduler(weights, pol, slots=1)
    assert sched.stats()["tokens_per_s"] == 0.0  # fewer than two calls: no window
    sched._rate = deque([(10.0, 5), (11.0, 3), (12.0, 4)])
    assert sched.stats()["tokens_per_s"] == pytest.approx(3.5)
    sched.close()


# -- KV by the page ----------------------------------------------------------------------------------------------------
PAGED = ["full", "delta", "delta-refine", "lychee", "quest", "vattention", "vattention-delta"]


def boundary_requests(seed: int, count: int) -> list[Request]:
    """Requests whose prompts end at page boundaries (15, 16, 17, 31, 32, 33 tokens, …) and whose answers cross them."""
    rng = random.Random(seed)
    return [Request([rng.randrange(256) for _ in range(rng.choice([1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 95]))],
                    max_new_tokens=rng.choice([1, 2, 15, 16, 17, 18]), ignore_eos=True) for _ in range(count)]


@pytest.mark.parametrize("policy, family", [
    (policy, family) for policy in PAGED for family in ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
    if not (policy == "delta-refine" and family == "mistral")  # refining has no step for windowed sparse layers
])
def test_paged_and_contiguous_rows_give_the_same_tokens(policy, family):
    """The rows of a scheduler whose cache is a pool of pages read through block tables (the default for these
    policies) give every request the tokens the same scheduler gives it over a contiguous cache, and each request's
    alone: prompts and answers at page boundaries, rows reused, every family (Gemma 3's sliding layers keep their
    rings beside the pool; Mistral's window reads through the table)."""
    model, weights, pol = served(policy, family)
    requests = boundary_requests(2, 9)
    paged, sched = serve_all(weights, pol, requests, slots=3, check_every=3, min_context=0)
    assert sched.engine.dec.cache.paged and sched.engine.tables is not None
    flat, contiguous = serve_all(weights, pol, requests, slots=3, check_every=3, min_context=0, paged=False)
    assert not contiguous.engine.dec.cache.paged
    for i, r in enumerate(requests):
        alone = generate(weights, pol, [list(r.prompt)], max_new_tokens=r.max_new_tokens, min_context=0).tokens[0]
        assert paged.tokens[i] == flat.tokens[i] == alone, (policy, family, i)
    assert sched.stats()["kv_pages_used"] == 0  # every page came back


@pytest.mark.parametrize("policy", PAGED)
def test_preempted_requests_resume_to_the_tokens_of_an_uninterrupted_run(policy):
    """A pool of 13 pages (208 tokens) under four rows of requests of up to 150 tokens: the pool runs out mid-decode,
    the latest requests are preempted (their KV to host memory) and resumed in other pages, and every request still
    gets exactly the greedy tokens it gets alone (a sampled one those of its seed), with every page back at the
    end."""
    model, weights, pol = served(policy)
    rng = random.Random(5)
    requests = [Request([rng.randrange(256) for _ in range(rng.randint(20, 70))], rng.randint(30, 80),
                        ignore_eos=True) for _ in range(6)]
    requests[2] = Request(requests[2].prompt, 40, Sampling(True, 0.8, 20, 0.9, seed=3), ignore_eos=True)
    got, sched = serve_all(weights, pol, requests, slots=4, check_every=4, min_context=0, kv_pages=14)
    stats = sched.stats()
    assert stats["preemptions"] > 0 and stats["kv_pages_total"] == 13
    for i, r in enumerate(requests):
        alone = generate(weights, pol, [list(r.prompt)], max_new_tokens=r.max_new_tokens, sampling=r.sampling,
                         min_context=0).tokens[0]
        assert got.tokens[i] == alone, (policy, i)
        assert got.finish[i] == "length"
    assert stats["kv_pages_used"] == 0


def test_a_request_that_could_never_fit_the_pool_is_refused_at_once():
    model, weights, pol = served("full")
    with Scheduler(weights, pol, slots=2, max_context=512, kv_pages=5) as sched:  # 4 pages: 64 tokens
        with pytest.raises(RequestError, match="the request needs 69 tokens of KV .5 pages of 16. and this server's "
                                               "pool holds 4 pages .64 tokens.") as err:
            sched.submit(Request([1] * 60, 10), lambda event: None)
        assert err.value.field == "prompt"
        got = Collector()
        sched.submit(Request([1] * 60, 5, ignore_eos=True), got.emit(0))  # 64 tokens written: fits
        got.wait(1)
        assert len(got.tokens[0]) == 5


def test_pages_come_back_after_cancels_failing_callbacks_and_finishes():
    """A load with cancelled requests (a client that went away), a callback that raises (a broken connection) and
    requests that run to their end: afterwards no page is held."""
    model, weights, pol = served("delta")
    got = Collector()
    broken = threading.Event()

    def breaks(event) -> None:
        broken.set()
        raise ConnectionError("the client went away")

    with Scheduler(weights, pol, slots=3, check_every=2, min_context=0, kv_pages=20) as sched:
        ids = [sched.submit(r, got.emit(i)) for i, r in enumerate(random_requests(8, 6))]
        sched.submit(Request([7] * 40, 30, ignore_eos=True), breaks)
        sched.cancel(ids[1])
        sched.cancel(ids[4])
        got.wait(6)
        assert broken.wait(60)
        for _ in range(200):  # the broken request is cancelled at the next step boundary
            if sched.stats()["running"] == 0:
                break
            threading.Event().wait(0.05)
        stats = sched.stats()
        assert stats["running"] == 0 and stats["kv_pages_used"] == 0, stats


@pytest.mark.gpu
@pytest.mark.parametrize("policy", PAGED)
def test_preemption_on_gpu_gives_each_request_its_tokens_alone(policy):
    """The tiny model on the GPU (Triton kernels reading block tables, CUDA graphs): a pool of 14 pages under four rows
    preempts requests mid-decode and puts their KV back into other pages; each request still gets the very tokens
    it gets alone through a scheduler of the same rows and pool, and every page comes back."""
    model, _, pol = served(policy)
    weights = Weights.from_model(model.to("cuda"), positions=512)
    rng = random.Random(5)
    requests = [Request([rng.randrange(256) for _ in range(rng.randint(20, 70))], rng.randint(30, 80),
                        ignore_eos=True) for _ in range(6)]
    got, sched = serve_all(weights, pol, requests, slots=4, check_every=4, min_context=0, kv_pages=14)
    assert sched.stats()["preemptions"] > 0 and sched.stats()["kv_pages_used"] == 0
    alone = Collector()
    with Scheduler(weights, pol, slots=4, check_every=4, min_context=0, kv_pages=14) as one:
        for i, r in enumerate(requests):
            one.submit(r, alone.emit(i))
            alone.wait(1)
    for i in range(len(requests)):
        assert got.tokens[i] == alone.tokens[i], (policy, i)
