"""The engine's sizes and decisions at their exact ends, worked by hand: a ring's slot at a multiple of its length,
cache bytes with and without rings, prefill chunks and graph widths at their thresholds, a prompt that fills
the cache to the slot, top-k ties and a nucleus at an exact mass, row buckets and kept decoders at a power of two,
a row's end at its first or last token, a token limit of 1, a reused row's books, crossovers at a measured batch
or budget exactly, and the share read at the crossover's context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rolecall.runtime.engine.cache import KeySpan, StaticCache, ring_lengths, ring_slots, ring_span
from rolecall.runtime.engine.shape import ModelShape


def _shape(layers=2, windows=(), kv_heads=2, head_dim=4):
    return ModelShape(layers=layers, hidden=8, heads=kv_heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=8,
                      vocab=16, windows=tuple(windows))


# -- the cache -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, positions, slots", [
    (4, [0, 1, 3, 4, 7, 8], [3, 2, 0, 3, 0, 3]),  # n - 1 - (p mod n): a multiple of n starts the ring again
    (4, [-1, -4], [4, 4]),  # padding goes to slot n, which no step reads
    (1, [0, 5, -1], [0, 0, 1]),
])
def test_ring_slots(n, positions, slots):
    assert ring_slots(torch.tensor(positions), n).tolist() == slots


@pytest.mark.parametrize("n, positions, first", [
    (4, [0, 2, 3, 4, 10], [3, 1, 0, 0, 0]),  # the last min(p + 1, n) tokens: from slot n - 1 - p, at least 0
    (1, [0, 7], [0, 0]),
])
def test_ring_span_reads_the_last_min_p_plus_1_n_tokens(n, positions, first):
    span = ring_span(torch.tensor(positions), n, torch.tensor(n - 1))
    assert span.first.tolist() == first and int(span.last) == n - 1


@pytest.mark.parametrize("windows, slots, rings", [
    ((None, 4, None, 8), 6, {1: 4, 3: 6}),  # a window longer than the cache: a ring of the cache's slots
    ((None, 4, None, 8), 8, {1: 4, 3: 8}),
    ((4, 4, 4, 4), 6, {}),  # a window on every layer (Mistral): no rings
    ((None,) * 4, 6, {}),
])
def test_ring_lengths(windows, slots, rings):
    assert ring_lengths(_shape(layers=4, windows=windows), slots) == rings


@pytest.mark.parametrize("windows, batch, slots, held", [
    ((None, None), 3, 10, 20),  # 10 + 10 slots
    ((None, 4), 3, 10, 15),  # 10 + a ring of 4 and its padding slot
    ((None, 4), 3, 3, 7),  # a ring no longer than the cache: 3 + 3 + 1
    ((None, 4), 1, 4, 9),
])
def test_cache_bytes_needed(windows, batch, slots, held):
    """2 (K and V) × 2 bytes × batch × 2 KV heads × head_dim 4 × slots held over the layers."""
    shape = _shape(windows=windows)
    assert StaticCache.bytes_needed(shape, batch, slots) == 2 * 2 * batch * 2 * 4 * held
    assert StaticCache(shape, batch, slots, "cpu", torch.float16).nbytes == 2 * 2 * batch * 2 * 4 * held


@pytest.mark.parametrize("windows, layer_slots, sizes, least", [
    ((None, 4), None, [6, 5], 6),  # the ring (4 + 1) is not counted in min_slots
    ((None, None), {0: 3}, [3, 6], 3),  # a compact layer
    ((None, None), {0: 9}, [6, 6], 6),  # never more than the cache's slots
])
def test_cache_layer_sizes_and_min_slots(windows, layer_slots, sizes, least):
    c = StaticCache(_shape(windows=windows), 2, 6, "cpu", torch.float32, layer_slots=layer_slots)
    assert [k.shape[2] for k in c.k] == sizes and c.min_slots == least


def test_a_row_view_shares_its_rows_memory_and_starts_empty():
    c = StaticCache(_shape(), 3, 4, "cpu", torch.float32, row_lengths=True)
    c.length.fill_(2)
    view = c.row(2)
    view.k[0].fill_(1.0)
    assert c.k[0][2].eq(1.0).all() and c.k[0][:2].eq(0.0).all()  # row 2 and no other
    assert view.batch == 1 and int(view.length) == 0 and view.length.dim() == 0 and view.pads.tolist() == [0]
    assert c.length.tolist() == [2, 2, 2]


@pytest.mark.parametrize("first, last, mask", [
    ([1, 0], 2, [[False, True, True, False], [True, True, True, False]]),  # first and last inclusive
    ([1, 0], [2, 3], [[False, True, True, False], [True, True, True, True]]),  # each row's own last
    ([3, 0], 0, [[False] * 4, [True, False, False, False]]),  # first past last: nothing
])
def test_key_span_mask_is_inclusive_at_both_ends(first, last, mask):
    assert KeySpan(torch.tensor(first), torch.tensor(last)).as_mask(4).tolist() == mask


# -- prefill ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows, padded, chunk", [
    (1, False, 32768), (7, False, 4681), (8, False, 4096), (9, False, 4096), (0, False, 32768), (1, True, 4096),
])
def test_chunk_for(rows, padded, chunk):
    from rolecall.runtime.engine.prefill import chunk_for

    assert chunk_for(rows, padded) == chunk


@pytest.mark.parametrize("longest, rows, width", [
    (1, 1, 16), (16, 1, 16), (17, 1, 24), (24, 1, 24), (1024, 1, 1024), (1025, 1, None),
    (1024, 4, 1024),  # 4 × 1024 = GRAPH_TOKENS exactly
    (1024, 5, None), (256, 16, 256), (256, 17, None), (200, 16, 256),
])
def test_graph_width(longest, rows, width):
    from rolecall.runtime.engine.prefill import graph_width

    assert graph_width(longest, rows) == width


def _dec(min_slots, slots, batch=1, position=0):
    return SimpleNamespace(cache=SimpleNamespace(min_slots=min_slots, slots=slots), batch=batch, position=position)


@pytest.mark.parametrize("min_slots, slots, p, pads, fits", [
    (8, 8, 8, [0], True),  # a prompt of every slot
    (8, 8, 9, [0], False),
    (5, 8, 4, [0], True),  # a compact layer keeps one slot free for the first new token
    (5, 8, 5, [0], False),
    (8, 8, 3, [2], True),  # each row needs one token: pads < p
    (8, 8, 3, [3], False),
    (8, 8, 3, [-1], False),
])
def test_check_fits(min_slots, slots, p, pads, fits):
    from rolecall.runtime.engine.prefill import _check_fits

    if fits:
        _check_fits(_dec(min_slots, slots), 1, p, pads)
    else:
        with pytest.raises(ValueError, match="does not fit"):
            _check_fits(_dec(min_slots, slots), 1, p, pads)


def test_check_fits_needs_an_empty_cache_and_the_decoders_rows():
    from rolecall.runtime.engine.prefill import _check_fits

    with pytest.raises(RuntimeError, match="empty cache"):
        _check_fits(_dec(8, 8, position=1), 1, 2, [0])
    with pytest.raises(ValueError, match="does not fit"):
        _check_fits(_dec(8, 8, batch=2), 1, 2, [0])


# -- sampling --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k, kept", [
    (1, [True, False, False, False]),
    (2, [True, True, True, False]),  # a tie at the k-th value keeps both tied tokens
    (3, [True, True, True, False]),
    (4, [True, True, True, True]),  # k = V: nothing dropped
    (0, [True, True, True, True]),  # 0 = off
])
def test_filtered_logits_top_k_keeps_ties_at_the_kth(top_k, kept):
    from rolecall.runtime.engine.sampling import filtered_logits

    got = filtered_logits(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), top_k, 1.0)
    assert torch.isfinite(got).tolist() == [kept]


@pytest.mark.parametrize("top_p, kept", [
    # four equal tokens: the mass before each is 0, 1/4, 1/2, 3/4 (exact in floats); a token is dropped once the
    # mass before it reaches top_p
    (0.25, 1), (0.2500001, 2), (0.5, 2), (0.5000001, 3), (0.75, 3), (0.7500001, 4), (1.0, 4), (1e-9, 1),
])
def test_filtered_logits_nucleus_at_an_exact_mass(top_p, kept):
    from rolecall.runtime.engine.sampling import filtered_logits

    assert int(torch.isfinite(filtered_logits(torch.zeros(1, 4), 0, top_p)).sum()) == kept


def test_row_sampler_books_of_a_reused_row():
    """A row given a greedy request after a sampling one forgets the temperature and counts draws from the step
    given; the mode is greedy once no row samples."""
    from rolecall.runtime.engine.sampling import RowSampler, Sampling

    s = RowSampler(2, "cpu")
    assert s.mode == "greedy"
    s.set_row(0, Sampling(do_sample=True, temperature=0.5, top_k=3, top_p=0.9, seed=7), 1)
    assert s.mode == "sample" and float(s.temperature[0]) == 0.5 and s.step.tolist() == [1, 0]
    s.free_row(0)
    assert s.mode == "greedy"  # the one sampling row ended
    s.set_row(0, Sampling(do_sample=True, temperature=0.5), 1)
    s.set_row(1, Sampling(do_sample=True, seed=3), 1)
    s.free_row(0)
    assert s.mode == "sample"  # row 1 still samples
    s.set_row(0, Sampling(temperature=0.3), 5)  # greedy: its temperature is not used, the row's is 1 again
    assert float(s.temperature[0]) == 1.0 and int(s.top_k[0]) == 0 and s.step.tolist() == [5, 1]
    s.set_row(1, Sampling(), 1)
    assert s.mode == "greedy" and not s.sample.any()


@pytest.mark.parametrize("settings", [
    {"do_sample": True, "top_k": 1, "seed": 11},  # one token kept
    {"do_sample": True, "top_p": 1e-6, "seed": 5},  # the nucleus of the most likely token alone
    {"do_sample": True, "temperature": 1e-4, "seed": 2},
    {},  # a greedy row in a sampling step takes its argmax
])
def test_row_sampler_rows_that_can_only_take_the_argmax(settings):
    from rolecall.runtime.engine.sampling import RowSampler, Sampling

    s = RowSampler(2, "cpu")
    s.set_row(0, Sampling(do_sample=True, seed=1), 1)  # keeps the step in its sampling mode
    s.set_row(1, Sampling(**settings), 1)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.1, 2.0, 1.9, -1.0, 0.5]])
    for _ in range(3):
        assert int(s(logits)[1]) == 1


@pytest.mark.parametrize("top_k, top_p, drawn", [
    (2, 1.0, {0, 1, 2}),  # the tie at the 2nd value keeps tokens 1 and 2, as filtered_logits and transformers do
    (1, 1.0, {0}),
    (3, 1.0, {0, 1, 2}),
    (0, 1.0, {0, 1, 2, 3}),
])
def test_row_sampler_keeps_ties_at_the_kth_value(top_k, top_p, drawn):
    """Logits 3, 2, 2, 1 at temperature 1: over 64 seeds a row draws each token its filter keeps (each has a
    probability of at least e¹ / (e³ + 2e² + e) ≈ 0.08) and none other."""
    from rolecall.runtime.engine.sampling import RowSampler, Sampling

    got = set()
    for seed in range(64):
        s = RowSampler(1, "cpu")
        s.set_row(0, Sampling(do_sample=True, top_k=top_k, top_p=top_p, seed=seed), 0)
        got.add(int(s(torch.tensor([[3.0, 2.0, 2.0, 1.0]]))[0]))
    assert got == drawn


# -- buckets, kept decoders ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (8, 8), (9, 12), (12, 12), (13, 16),
                                          (256, 256), (257, 257)])
def test_rows_for(rows, bucket):
    from rolecall.runtime.engine.compiling import rows_for

    assert rows_for(rows) == bucket


@pytest.mark.parametrize("slots, most, got", [
    (1, 10_000, 256),  # MIN_SLOTS at least
    (100, 10_000, 256),
    (256, 10_000, 256),  # a power of two stays
    (257, 10_000, 320),  # one past: a step of 512 / 8 = 64
    (300, 10_000, 320),
    (1024, 10_000, 1024),
    (1025, 10_000, 1280),
    (1152, 10_000, 1280),  # 1152 is a multiple of 128, not of the 2048 / 8 = 256 it rounds to
    (300, 310, 310),  # within `most`
    (300, 200, 300),  # never below `slots`
])
def test_slots_for_rounds_up_to_an_eighth_of_the_next_power_of_two(slots, most, got):
    from rolecall.runtime.engine.generate import Decoders

    assert Decoders.slots_for(slots, most) == got


@pytest.mark.parametrize("max_len, slots, taken", [
    (512, 512, True),  # exactly its size
    (512, 513, False),
    (512, 256, True),  # half its cache exactly
    (512, 255, False),
    (256, 1, True),  # any part of the smallest
])
def test_a_kept_decoder_takes_requests_of_at_least_half_its_cache(max_len, slots, taken):
    from rolecall.runtime.engine.generate import Decoders

    dec = SimpleNamespace(max_len=max_len, reusable=True, resets=0)
    dec.reset = lambda: setattr(dec, "resets", dec.resets + 1)
    w, p = object(), object()
    d = Decoders()
    d.keep(w, p, ("kind",), dec)
    got = d.take(w, p, ("kind",), slots)
    assert (got is dec) == taken and dec.resets == int(taken)
    assert (d.kept is dec) == taken  # a request that does not fit frees the kept decoder


# -- where a row ends ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("row, cut, eos, end", [
    ([5, 7, 2, 9], None, [2], (3, "eos")),  # the EOS is kept
    ([2, 7], None, [2], (1, "eos")),  # at the first token
    ([5, 7, 9, 2], None, [2], (4, "eos")),  # at the last
    ([5, 7, 9], None, [2], (3, "length")),
    ([5, 2, 2], None, [2], (2, "eos")),  # the first of two
    ([5, 7, 2, 9], 2, [2], (2, "stop")),  # a stop string wins over a later EOS
    ([], None, [2], (0, "length")),
])
def test_row_end(row, cut, eos, end):
    from rolecall.runtime.engine.generate import _row_end

    assert _row_end(row, cut, eos) == end


class _Letters:
    """A tokenizer whose id i is the letter 'a' + i."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


@pytest.mark.parametrize("stops, cut", [
    (["cd"], 4), (["a"], 1), (["e"], 5), (["abcde"], 5), (["x"], None), ([], None), (["de", "b"], 2),
])
def test_cut_at_stop_is_the_shortest_prefix_holding_a_stop(stops, cut):
    from rolecall.runtime.engine.text import cut_at_stop

    assert cut_at_stop(_Letters(), [0, 1, 2, 3, 4], stops) == cut


@pytest.mark.parametrize("stops, eos, end", [(["c"], [9], (3, "stop")), ([], [1], (2, "eos")), (["z"], [], (4, "length"))])
def test_answer_end(stops, eos, end):
    from rolecall.runtime.engine.generate import answer_end

    assert answer_end([0, 1, 2, 3], eos, stops, _Letters()) == end


@pytest.mark.parametrize("sent, cut, eos, put, back", [
    (0, None, [], [1, 2, 3], 3),
    (3, None, [], None, 3),  # everything sent: nothing put
    (0, None, [2], [1, 2], 2),  # up to the EOS, inclusive
    (2, None, [2], None, 2),
    (3, None, [2], None, 3),  # sent past the end never goes back
    (1, 2, [], [2], 2),
])
def test_stream_hands_on_up_to_the_rows_end(sent, cut, eos, put, back):
    from rolecall.runtime.engine.generate import _stream

    got = []
    streamer = SimpleNamespace(put=lambda t: got.append(t.tolist()))
    assert _stream(streamer, [1, 2, 3], sent, cut, eos) == back
    assert got == ([] if put is None else [put])


# -- stopping ----------------------------------------------------------------------------------------------------------------
def test_stopper_finishes_at_the_limit_and_on_eos_and_resets():
    from rolecall.runtime.engine.generate import Stopper

    s = Stopper(2, [1, 3], [9], 0, "cpu")
    assert s.width == 3
    assert s(torch.tensor([4, 5])).tolist() == [4, 5]
    assert s.finished.tolist() == [True, False]  # a limit of 1: one token
    assert s(torch.tensor([6, 9])).tolist() == [0, 9]  # a finished row emits padding; EOS finishes
    assert s.finished.tolist() == [True, True] and s.out.tolist() == [[4, 0, 0], [5, 9, 0]]
    s.reset([3, 3])  # up to the width exactly
    assert s.finished.tolist() == [False, False] and int(s.count) == 0 and s.out.eq(0).all()
    s(torch.tensor([1, 1]))
    s(torch.tensor([1, 1]))
    assert s.finished.tolist() == [False, False]
    s(torch.tensor([1, 1]))
    assert s.finished.tolist() == [True, True]
    with pytest.raises(ValueError, match="up to 3 tokens"):
        s.reset([4, 1])


@pytest.mark.parametrize("limit, first, done", [(1, 4, True), (2, 4, False), (0, 4, True), (3, 9, True)])
def test_row_stopper_set_row(limit, first, done):
    from rolecall.runtime.engine.batcher import RowStopper

    s = RowStopper(2, 1, 0, "cpu")
    assert s.set_row(0, limit, [9], first) is done
    assert s.finished.tolist() == [done, True] and s.count.tolist() == [1, 0]


def test_row_stopper_a_reused_row_starts_its_books_again():
    from rolecall.runtime.engine.batcher import RowStopper

    s = RowStopper(2, 2, 0, "cpu")
    s.set_row(0, 2, [9], 4)
    assert s(torch.tensor([5, 7])).tolist() == [5, 0]  # row 1 is idle: padding
    assert s.emitted.tolist() == [True, False] and s.finished.tolist() == [True, True]  # 2 tokens: its limit
    # the row again, a request of 3 tokens that ignores EOS: count from 1, and 9 no longer ends it
    assert s.set_row(0, 3, [], 4) is False
    assert s.eos[0].tolist() == [-1, -1]
    s(torch.tensor([9, 0]))
    assert s.finished.tolist() == [False, True] and s.count.tolist()[0] == 2
    s(torch.tensor([9, 0]))
    assert s.finished.tolist() == [True, True] and s.count.tolist()[0] == 3
    s(torch.tensor([8, 0]))
    assert s.emitted.tolist() == [False, False] and s.count.tolist()[0] == 3  # a finished row counts no more


@pytest.mark.parametrize("eos, row", [([9], [9, -1]), ([7, 8, 9], [7, 8]), ([], [-1, -1])])
def test_row_stopper_eos_ids_fill_its_width(eos, row):
    from rolecall.runtime.engine.batcher import RowStopper

    s = RowStopper(1, 2, 0, "cpu")
    s.set_row(0, 5, eos, 1)
    assert s.eos[0].tolist() == row


# -- the decode loop's steps -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit, done_after, check_every, steps", [
    (1, None, 8, 0),  # a limit of 1: the prefill's token, no step
    (2, None, 8, 1),
    (5, None, 8, 4),  # the last check is at the limit, not at a multiple of check_every
    (5, 2, 2, 2),  # finished at a check: stop there
    (5, 2, 3, 3),  # finished between checks: the next check sees it
    (9, 1, 4, 4),
])
def test_loop_runs_limit_minus_one_steps_and_stops_at_the_check_after_the_end(limit, done_after, check_every,
                                                                                steps):
    from rolecall.runtime.engine.generate import _Loop

    finished = torch.zeros(1, dtype=torch.bool)
    dec = SimpleNamespace(n=0)

    def step():
        dec.n += 1
        if done_after is not None and dec.n >= done_after:
            finished.fill_(True)

    dec.step = step
    loop = _Loop(dec, SimpleNamespace(finished=finished), [limit], [], (), None, None)
    assert loop.run(check_every) == steps == dec.n


# -- crossovers ----------------------------------------------------------------------------------------------------------------
TABLE = {"budget": 2048, "policies": {"p": [
    {"from_batch": 1, "min_context": 100}, {"from_batch": 8, "min_context": 50},
    {"from_batch": 8, "min_context": 30, "budget": 1024}, {"from_batch": 4, "min_context": None, "budget": 4096}]}}


@pytest.mark.parametrize("batch, budget, want", [
    (1, None, 100), (7, None, 100),
    (8, None, 50),  # a row applies from its batch exactly
    (9, None, 50),
    (8, 1024, 30),  # a budget measured exactly
    (7, 1024, 100),  # no row of that budget fits the batch: the next larger budget's
    (8, 1025, 50),  # a budget between two measured ones takes the larger's rows
    (8, 2048, 50),
    (4, 2049, "never"),  # null = never faster
    (3, 2049, "never"),  # no row fits anywhere
    (4, 5000, "never"),  # above every measured budget: the largest
    (8, 5000, "never"),  # (not the smallest, whose batch-8 row says 30)
])
def test_default_min_context_at_measured_batches_and_budgets(monkeypatch, batch, budget, want):
    from rolecall.runtime.engine import crossovers

    monkeypatch.setattr(crossovers, "table", lambda: TABLE)
    got = crossovers.default_min_context("p", batch, budget)
    assert got == (crossovers.NEVER if want == "never" else want)


def test_default_min_context_without_rows_or_rows_of_none(monkeypatch):
    from rolecall.runtime.engine import crossovers

    monkeypatch.setattr(crossovers, "table", lambda: TABLE)
    assert crossovers.default_min_context("full", 1) == 0
    with pytest.raises(ValueError, match="batch must be at least 1"):
        crossovers.default_min_context("p", 0)
    # a policy's own budget: 2 pages of 512 = 1024
    assert crossovers.default_min_context(SimpleNamespace(name="p", num_pages=2, page_size=512), 8) == 30


@pytest.mark.parametrize("policy, budget", [
    (SimpleNamespace(num_pages=4, page_size=16, budget=1000), 64),  # pages win over a budget
    (SimpleNamespace(budget=100), 100),
    (SimpleNamespace(num_pages=None, page_size=16, budget=7), 7),
    (SimpleNamespace(budget=None), None),
    (SimpleNamespace(budget=0.5), None),
])
def test_budget_of(policy, budget):
    from rolecall.runtime.engine.crossovers import budget_of

    assert budget_of(policy) == budget


# -- the share of the context read -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("min_context, steps, share", [
    # prompt 2, steps at t = 2 and 3 read contexts 3 and 4; the full step reads c, the sparse one c / 2
    (3, 2, (3 + 2) / 7),  # t = 2 < 3 runs the full step, t = 3 (= min_context) the sparse one
    (4, 2, 1.0),
    (2, 2, 0.5),
    (0, 1, 0.5),
    (3, 0, None),  # no step
])
def test_fraction_runs_the_full_step_below_min_context(min_context, steps, share):
    from rolecall.runtime.engine.generate import _fraction

    dec = SimpleNamespace(shape=None, min_context=min_context,
                          static=SimpleNamespace(sparse=True, reads=lambda shape, c: c / 2),
                          full=SimpleNamespace(reads=lambda shape, c: c))
    got = _fraction(dec, 2, steps)
    assert got == (None if share is None else pytest.approx(share))


# -- shapes ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("windows, sliding", [
    ((None, 4, None), (1,)), ((4, 4, None), (0, 1)), ((4, 4, 4), ()), ((None, None, None), ()),
])
def test_sliding_layers_are_windowed_layers_of_a_hybrid_only(windows, sliding):
    assert _shape(layers=3, windows=windows).sliding_layers == sliding


@pytest.mark.parametrize("batch, tokens, size", [(1, 10, 2 * 2 * 1 * 2 * 2 * 10 * 4), (3, 0.5, 2 * 2 * 3 * 2 * 2 * 0.5 * 4)])
def test_kv_bytes(batch, tokens, size):
    """2 (K and V) × 2 bytes × batch × 2 layers × 2 KV heads × tokens × head_dim 4."""
    assert _shape().kv_bytes(batch, tokens) == size


def test_weight_bytes_by_hand():
    """hidden 8, 2 heads of 4 (q, k, v: 24 rows), bias, o 8×8, MLP 3·8·8, two norms of 8; 2 layers, final norm,
    embedding 16×8 and batch rows of it, 2 bytes each."""
    per_layer = 8 * 24 + 24 + 8 * 8 + 3 * 8 * 8 + 2 * 8
    assert _shape().weight_bytes(3) == 2 * (2 * per_layer + 8 + 16 * 8 + 3 * 8)


# -- a request's rows ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, graphs, width, compile_flag, ids, limits", [
    ([[1, 2], [3]], False, None, "0", [[1, 2], [0, 3]], [4, 4]),
    ([[1, 2], [3]], False, 1, "0", [[1, 2], [0, 3]], [4, 4]),  # a width below the longest prompt: the prompt's
    ([[1, 2], [3]], False, 3, "0", [[0, 1, 2], [0, 0, 3]], [4, 4]),
    ([[1, 2], [3], [4]], False, None, "1", [[1, 2], [0, 3], [0, 4], [0, 0]], [4, 4, 4, 1]),  # 3 rows: bucket 4
    ([[1], [2]], False, None, "1", [[1], [2]], [4, 4]),  # 2 rows are a bucket
])
def test_rows_pad_to_the_bucket_and_width(monkeypatch, prompts, graphs, width, compile_flag, ids, limits):
    from rolecall.runtime.engine.generate import Decoders, _rows

    monkeypatch.setenv("ROLECALL_COMPILE", compile_flag)
    weights = SimpleNamespace(device=torch.device("cpu"))
    rows, got_limits, got_ids, pads = _rows(weights, prompts, [4] * len(prompts), 0, graphs, Decoders(), width)
    assert got_ids.tolist() == ids and got_limits == limits
    assert pads == [len(ids[0]) - len(r) for r in rows] and rows[len(prompts):] == [[0]] * (len(ids) - len(prompts))


def test_rows_on_graphs_pad_to_a_graph_width():
    from rolecall.runtime.engine.generate import _rows

    _, _, ids, pads = _rows(SimpleNamespace(device=torch.device("cpu")), [[1] * 17, [2]], [1, 1], 0, True, None, None)
    assert ids.shape == (2, 24) and pads == [7, 23]


def test_loop_checks_at_its_last_step_between_multiples_of_check_every():
    """With 3 steps and checks every 8, the one check is at the last step: the streamer gets all three tokens."""
    from rolecall.runtime.engine.generate import _Loop

    out, count = torch.zeros(1, 4, dtype=torch.long), torch.zeros((), dtype=torch.long)

    def step():
        out[0, int(count)] = 10 + int(count)
        count.add_(1)

    got = []
    stopper = SimpleNamespace(finished=torch.zeros(1, dtype=torch.bool), out=out, count=count)
    loop = _Loop(SimpleNamespace(step=step), stopper, [4], [], (), None, SimpleNamespace(put=lambda t: got.append(t.tolist())))
    assert loop.run(8) == 3 and got == [[10, 11, 12]]
