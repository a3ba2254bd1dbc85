"""KV pages: the pool's free list and reference counts, the requests' page lists under random admissions, growth,
preemption and release (no page leaks, none shared by mistake), and paged attention against a contiguous cache
holding the same tokens, at page-boundary lengths."""

from __future__ import annotations

import random

import pytest
import torch

from rolecall.runtime.engine.pages import NULL_PAGE, PagePool, PageTables
from rolecall.runtime.kernels.paged_attention import gather_pages, paged_decode_attention, write_tokens
from rolecall.runtime.kernels.sparse_attention import sparse_decode_attention
from rolecall.runtime.memory import pages


def test_the_pool_hands_out_every_page_but_the_null_one_once():
    pool = PagePool(5)
    got = pool.take(4)
    assert sorted(got) == [1, 2, 3, 4] and NULL_PAGE not in got and pool.free == 0 and pool.used == 4
    with pytest.raises(MemoryError, match="1 pages asked for, 0 free of 4"):
        pool.take(1)
    pool.share(got[0])
    pool.give_back(got)
    assert pool.free == 3 and pool.refs(got[0]) == 1  # still held by its second holder
    pool.give_back([got[0]])
    assert pool.free == 4 and pool.used == 0
    with pytest.raises(ValueError, match="already free"):
        pool.give_back([got[0]])
    with pytest.raises(ValueError, match="only a held page"):
        pool.share(got[0])
    with pytest.raises(ValueError, match="at least 2 pages"):
        PagePool(1)


def test_reserve_is_all_or_nothing_and_release_returns_every_page():
    tables = PageTables(PagePool(6))  # 5 pages to hand out
    assert tables.reserve("a", 17) and tables.pages_of("a") == [1, 2]  # 17 tokens: 2 pages
    assert tables.reserve("a", 32) and tables.pages_of("a") == [1, 2]  # still 2
    assert tables.reserve("b", 48) and tables.pool.free == 0
    assert not tables.fits(1)
    assert not tables.reserve("a", 33)  # a third page: none free, nothing changes
    assert tables.pages_of("a") == [1, 2] and tables.pool.free == 0
    assert tables.youngest() == "b"
    assert tables.release("b") == 3 and tables.pool.free == 3 and tables.youngest() == "a"
    assert tables.reserve("a", 33) and len(tables.pages_of("a")) == 3 == tables.count("a")
    assert tables.release("nobody") == 0 and tables.count("nobody") == 0


def test_the_table_pads_with_the_null_page_and_bounds_a_row():
    tables = PageTables(PagePool(8))
    tables.reserve("a", 40)
    tables.reserve("b", 1)
    t = tables.table(["b", None, "a"], width=4)
    assert t.dtype == torch.int32 and t.tolist() == [[4, 0, 0, 0], [0, 0, 0, 0], [1, 2, 3, 0]]
    with pytest.raises(ValueError, match="holds 3 pages, more than the table's 2"):
        tables.table(["a"], width=2)


def test_random_admissions_growth_preemption_and_release_leak_nothing():
    rng = random.Random(0)
    tables = PageTables(PagePool(40))
    tokens: dict[int, int] = {}
    preempted = 0
    for step in range(2000):
        live = list(tokens)
        op = rng.random()
        if op < 0.3 or not live:  # admit a new request, at a page boundary length now and then
            want = rng.choice([1, 15, 16, 17, 31, 32, 33, rng.randint(1, 120)])
            if tables.reserve(step, want):
                tokens[step] = want
        elif op < 0.85:  # a request grows by a token or a few; out of pages: preempt the youngest, as the scheduler
            r = rng.choice(live)
            grown = tokens[r] + rng.randint(1, 20)
            while not tables.reserve(r, grown):
                victim = tables.youngest()
                tables.release(victim)
                del tokens[victim]
                preempted += 1
                if victim == r:
                    break
            else:
                tokens[r] = grown
        else:
            r = rng.choice(live)
            assert tables.release(r) == pages(tokens.pop(r))
        held = [p for r in tokens for p in tables.pages_of(r)]
        assert len(held) == len(set(held)) == tables.pool.used == sum(pages(n) for n in tokens.values())
        assert NULL_PAGE not in held
    assert preempted > 10  # the pool ran out, often
    for r in list(tokens):
        tables.release(r)
    assert tables.pool.used == 0 and tables.pool.free == 39


def fill(tables: PageTables, k_pages, v_pages, lengths: list[int], hkv: int, d: int, gen: torch.Generator):
    """Each sequence's tokens written one by one, the sequences interleaved (so their pages interleave in the pool);
    returns the contiguous ``[B, Hkv, T, D]`` K and V holding the same tokens."""
    t = max(lengths)
    k = torch.randn(len(lengths), hkv, t, d, generator=gen)
    v = torch.randn(len(lengths), hkv, t, d, generator=gen)
    for pos in range(t):
        rows = [b for b, n in enumerate(lengths) if pos < n]
        for b in rows:
            assert tables.reserve(b, pos + 1)
        table = tables.table(rows, width=pages(t))
        write_tokens(k_pages, v_pages, table, torch.full((len(rows),), pos), k[rows, :, pos], v[rows, :, pos])
    return k, v


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (7, 1)])
def test_paged_attention_equals_a_contiguous_cache_at_page_boundaries(hq, hkv):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    d, lengths = 8, [15, 16, 17, 1, 33, 48]
    tables = PageTables(PagePool(1 + sum(pages(n) for n in lengths)))
    k_pages = torch.full((tables.pool.num_pages, hkv, 16, d), float("nan"))  # an unwritten slot read would show
    v_pages = torch.full_like(k_pages, float("nan"))
    k_pages[NULL_PAGE] = 0
    v_pages[NULL_PAGE] = 0
    k, v = fill(tables, k_pages, v_pages, lengths, hkv, d, gen)
    assert tables.pages_of(2) != list(range(tables.pages_of(2)[0], tables.pages_of(2)[0] + 2))  # interleaved
    b, t = len(lengths), max(lengths)
    table = tables.table(list(range(b)), width=pages(t))
    held = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    mask = held[:, None, :].expand(-1, hkv, -1)
    assert torch.equal(gather_pages(k_pages, table)[:, :, :t][mask], k[mask])  # every held token written, in place
    assert torch.equal(gather_pages(v_pages, table)[:, :, :t][mask], v[mask])
    # the unwritten tails of last pages hold NaN, which a masked reference would still multiply by 0
    k_pages_read, v_pages_read = torch.nan_to_num(k_pages), torch.nan_to_num(v_pages)
    q = torch.randn(b, hq, d, generator=gen)
    out, lse = paged_decode_attention(q, k_pages_read, v_pages_read, table, torch.tensor(lengths), scale=0.3)
    want, want_lse = sparse_decode_attention(q, k, v, scale=0.3, key_mask=held)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    # a selection of pages (blocks of 16 tokens, logical ids): the same pages of the contiguous cache
    chosen = torch.tensor([[0, 2], [0, -1], [1, 0], [0, -1], [2, 1], [2, -1]])[:, None, :].expand(b, hkv, 2)
    out, lse = paged_decode_attention(q, k_pages_read, v_pages_read, table, torch.tensor(lengths), scale=0.3,
                                      indices=chosen.contiguous(), block_size=16)
    want, want_lse = sparse_decode_attention(q, k, v, chosen.contiguous(), scale=0.3, block_size=16, key_mask=held)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_a_preempted_request_recomputed_into_other_pages_reads_the_same():
    gen = torch.Generator().manual_seed(3)
    hkv, d = 2, 8
    tables = PageTables(PagePool(9))
    k_pages = torch.zeros(9, hkv, 16, d)
    v_pages = torch.zeros_like(k_pages)
    k, v = fill(tables, k_pages, v_pages, [40], hkv, d, gen)
    q = torch.randn(1, 4, d, generator=gen)
    before = paged_decode_attention(q, k_pages, v_pages, tables.table([0], 3), torch.tensor([40]), scale=0.5)
    first = tables.pages_of(0)
    tables.reserve("other", 20)  # another request takes the front of the free list meanwhile
    tables.release(0)
    tables.reserve(0, 40)
    assert tables.pages_of(0) != first
    for pos in range(40):  # the recompute writes the same K/V again
        write_tokens(k_pages, v_pages, tables.table([0], 3), torch.tensor([pos]), k[:, :, pos], v[:, :, pos])
    after = paged_decode_attention(q, k_pages, v_pages, tables.table([0], 3), torch.tensor([40]), scale=0.5)
    torch.testing.assert_close(after, before)


def test_reads_within_reach_give_the_same_attention_and_stop_at_the_last_readable_slot():
    from rolecall.runtime.engine.attention import within_reach
    from rolecall.runtime.engine.cache import KeySpan

    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(3, 2, 64, 8, generator=gen), torch.randn(3, 2, 64, 8, generator=gen)
    q = torch.randn(3, 4, 8, generator=gen)
    span = KeySpan(torch.tensor([0, 3, 0]), torch.tensor([9, 20, 4]))  # rows of their own lengths
    lethe_mask = torch.rand(3, 64, generator=gen) > 0.3
    near_k, near_v, near_mask, near_span = within_reach(span, k, v, lethe_mask)
    assert near_span is span
    assert near_k.shape[2] == near_v.shape[2] == near_mask.shape[1] == 21  # the longest row's last slot and it
    for indices, bs in [(None, 1), (torch.tensor([[[0, 3]] * 2, [[1, -1]] * 2, [[0, 2]] * 2]), 4)]:
        want = sparse_decode_attention(q, k, v, indices, scale=0.4, block_size=bs,
                                       key_mask=span.as_mask(64) & lethe_mask)
        got = sparse_decode_attention(q, near_k, near_v, indices, scale=0.4, block_size=bs,
                                      key_mask=span.as_mask(21) & near_mask)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the same up to summation order
    ring = KeySpan(torch.tensor([60, 0, 62]), torch.tensor(63))  # a ring's span ends at its top slot: nothing cut
    assert within_reach(ring, k, v, None)[0] is k


@pytest.mark.parametrize("kernels", ["naive", "triton"])
def test_the_new_token_is_stored_through_the_block_table(kernels):
    """``rope_and_store`` over a pool and block tables writes each row's new token (its own slot, at page boundaries
    15, 16, 17 and 0) where the contiguous cache holds it, returns the same query, and writes nothing else."""
    import importlib
    import os

    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    rope = importlib.import_module(f"rolecall.runtime.kernels.rope_cache.{kernels}")
    gen = torch.Generator().manual_seed(4)
    b, hq, hkv, d, w = 4, 4, 2, 8, 3
    y = torch.randn(b, (hq + 2 * hkv) * d, generator=gen)
    cos, sin = torch.randn(b, d, generator=gen), torch.randn(b, d, generator=gen)
    slot = torch.tensor([15, 16, 17, 0])
    k, v = torch.zeros(b, hkv, w * 16, d), torch.zeros(b, hkv, w * 16, d)
    want_q = rope.rope_and_store(y, hq, hkv, cos, sin, k, v, slot)
    table = (torch.randperm(b * w, generator=gen) + 1).view(b, w).to(torch.int32)
    kp, vp = torch.zeros(b * w + 1, hkv, 16, d), torch.zeros(b * w + 1, hkv, 16, d)
    q = rope.rope_and_store(y, hq, hkv, cos, sin, kp, vp, slot, block_table=table)
    torch.testing.assert_close(q, want_q)
    assert torch.equal(gather_pages(kp, table), k) and torch.equal(gather_pages(vp, table), v)
    assert not kp[NULL_PAGE].any() and not vp[NULL_PAGE].any()
    with pytest.raises(ValueError, match=r"block_table must be int32 \[B, W\] with B = 4"):
        rope.rope_and_store(y, hq, hkv, cos, sin, kp, vp, slot, block_table=table.long())
