"""The reference kernels against brute force written with Python loops over explicit sets."""

import math

import pytest
import torch

from rolecall.runtime.kernels.page_scores import page_scores
from rolecall.runtime.kernels.sparse_attention import indices_to_mask, sparse_decode_attention
from rolecall.runtime.kernels.topk_select import mask_to_indices, topk_with_recent


def brute_attention(q, k, v, sets, scale, weights):
    """sets[b][h] = list of token ids; weights[b][h][t] = multiplicity. Returns out [B, Hq, D], lse [B, Hq]."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq), -math.inf, dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            kv = h // g
            toks = sets[i][kv]
            if not toks:
                continue
            logits = torch.stack([scale * (q[i, h].double() @ k[i, kv, t].double()) for t in toks])
            w = torch.tensor([weights[i][kv].get(t, 1.0) for t in toks], dtype=torch.float64)
            e = w * torch.exp(logits)
            out[i, h] = sum(e[j] * v[i, kv, t].double() for j, t in enumerate(toks)) / e.sum()
            lse[i, h] = torch.log(e.sum())
    return out, lse


@pytest.mark.parametrize("t,groups,block", [(1, 1, 1), (17, 4, 1), (17, 7, 4), (100, 4, 16), (33, 1, 8)])
def test_sparse_attention_matches_brute_force(t, groups, block):
    torch.manual_seed(t * 31 + groups)
    b, hkv, d = 2, 2, 8
    q = torch.randn(b, hkv * groups, d)
    k, v = torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    n_blocks = math.ceil(t / block)
    width = max(1, n_blocks // 2 + 1)
    indices = torch.stack([torch.stack([torch.randperm(n_blocks)[:width] for _ in range(hkv)]) for _ in range(b)])
    indices[0, 1, -1] = -1  # padding
    log_w = torch.randn(b, hkv, indices.shape[-1]).abs()
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[1, : t // 3] = False  # left padding
    sets = [[[] for _ in range(hkv)] for _ in range(b)]
    weights = [[{} for _ in range(hkv)] for _ in range(b)]
    for i in range(b):
        for h in range(hkv):
            for j, blk in enumerate(indices[i, h].tolist()):
                if blk < 0:
                    continue
                for tok in range(blk * block, min((blk + 1) * block, t)):
                    if key_mask[i, tok]:
                        sets[i][h].append(tok)
                        weights[i][h][tok] = math.exp(float(log_w[i, h, j]))
    out, lse = sparse_decode_attention(q, k, v, indices, scale=0.3, block_size=block, log_weights=log_w,
                                       key_mask=key_mask)
    ref_out, ref_lse = brute_attention(q, k, v, sets, 0.3, weights)
    assert torch.allclose(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_dense_call_equals_softmax_attention():
    q, k, v = torch.randn(3, 8, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    out, lse = sparse_decode_attention(q, k, v, scale=0.25)
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    logits = torch.einsum("bhd,bhtd->bht", q, kk) * 0.25
    assert torch.allclose(out, torch.einsum("bht,bhtd->bhd", logits.softmax(-1), vv), atol=1e-5)
    assert torch.allclose(lse, logits.logsumexp(-1), atol=1e-5)


def test_log_weight_equals_duplicated_token():
    # A token with weight 2 counts as two copies of itself: compare with a cache where it is duplicated.
    q, k, v = torch.randn(1, 2, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    idx = torch.tensor([[[0, 2, 4]]])
    lw = torch.tensor([[[0.0, math.log(2.0), 0.0]]])
    out, _ = sparse_decode_attention(q, k, v, idx, scale=1.0, log_weights=lw)
    k2, v2 = k[:, :, [0, 2, 2, 4]], v[:, :, [0, 2, 2, 4]]
    ref, _ = sparse_decode_attention(q, k2, v2, scale=1.0)
    assert torch.allclose(out, ref, atol=1e-6)


def test_empty_set_gives_zero_and_minus_inf():
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    out, lse = sparse_decode_attention(q, k, v, torch.full((1, 2, 3), -1), scale=1.0)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def test_indices_to_mask_with_partial_last_block():
    mask = indices_to_mask(torch.tensor([[[2, -1, 0]]]), 4, 10)
    assert mask[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 9]


def test_topk_with_recent_matches_brute_force():
    torch.manual_seed(1)
    for n, k, recent in [(10, 4, 2), (7, 7, 3), (5, 9, 1), (20, 5, 0), (12, 3, 3)]:
        scores = torch.randn(3, n)
        valid = torch.rand(3, n) > 0.2
        got = topk_with_recent(scores, k, recent, valid)
        assert got.shape == (3, min(k, n))
        for row in range(3):
            ok = valid[row].tolist()
            forced = [i for i in range(max(n - recent, 0), n) if ok[i]]
            others = sorted((i for i in range(n) if ok[i] and i not in forced), key=lambda i: -float(scores[row, i]))
            want = sorted(forced + others[: max(min(k, n) - len(forced), 0)])
            row_ids = [i for i in got[row].tolist() if i >= 0]
            assert row_ids == want
            assert got[row].tolist()[len(want):] == [-1] * (min(k, n) - len(want))


def test_mask_to_indices():
    mask = torch.tensor([[True, False, True, True], [False, False, False, True]])
    assert mask_to_indices(mask).tolist() == [[0, 2, 3], [3, -1, -1]]


def test_page_scores_match_brute_force():
    torch.manual_seed(2)
    q, k = torch.randn(2, 6, 8), torch.randn(2, 3, 37, 8)
    key_mask = torch.ones(2, 37, dtype=torch.bool)
    key_mask[0, :5] = False
    got = page_scores(q, k, 0.5, 16, key_mask)
    assert got.shape == (2, 3)
    for b in range(2):
        probs = []
        for h in range(6):
            logits = torch.tensor([0.5 * float(q[b, h] @ k[b, h // 2, t]) if key_mask[b, t] else -math.inf
                                   for t in range(37)])
            probs.append(logits.softmax(-1))
        best = torch.stack(probs).amax(0)
        for u in range(3):
            assert abs(float(got[b, u]) - float(best[u * 16:(u + 1) * 16].sum())) < 1e-5


def test_topk_with_recent_over_positions_ranks_what_the_entries_stand_for():
    """``positions``: the entries are pages 10, 4, 7 and none; the recent window and ``last`` count in pages and
    the ids returned are pages, ascending (10 is the recent one, 7 beats 4 on score)."""
    scores = torch.tensor([[3.0, 1.0, 2.0, 5.0]])
    positions = torch.tensor([[10, 4, 7, -1]])
    got = topk_with_recent(scores, 2, 1, positions >= 0, positions=positions)  # last: the largest, 10
    assert got.tolist() == [[7, 10]]
    assert topk_with_recent(scores, 2, 1, positions >= 0, last=7, positions=positions).tolist() == [[4, 7]]
    assert topk_with_recent(scores, 4, 0, positions >= 0, positions=positions).tolist() == [[4, 7, 10, -1]]


@pytest.mark.parametrize("per_kv_head", [False, True])
@pytest.mark.parametrize("t,page", [(37, 16), (32, 16), (5, 1), (9, 4)])
def test_decode_and_score_pages_are_sums_of_the_head_max_by_brute_force(per_kv_head, t, page):
    """``decode_and_score``'s page scores: ``Σ_{t in page} max_h p_h[t]`` with the max over every query head, or
    over each KV head's group (``per_kv_head``), from softmax rows written out per head; the output is dense
    attention."""
    from rolecall.runtime.kernels.page_scores.naive import decode_and_score

    torch.manual_seed(t + page)
    b, hkv, g, d = 2, 2, 3, 8
    q, k, v = torch.randn(b, hkv * g, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[1, : t // 3] = False
    out, lse, scores = decode_and_score(q, k, v, 0.5, page, key_mask, per_kv_head=per_kv_head)
    pages = math.ceil(t / page)
    assert scores.shape == ((b, hkv, pages) if per_kv_head else (b, pages))
    sets = [[[i for i in range(t) if key_mask[r, i]] for _ in range(hkv)] for r in range(b)]
    want_out, want_lse = brute_attention(q, k, v, sets, 0.5, [[{}] * hkv] * b)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    for r in range(b):
        rows = []
        for h in range(hkv * g):
            logits = [0.5 * float(q[r, h] @ k[r, h // g, i]) if key_mask[r, i] else -math.inf for i in range(t)]
            rows.append(torch.tensor(logits, dtype=torch.float64).softmax(-1))
        groups = [rows[j * g:(j + 1) * g] for j in range(hkv)] if per_kv_head else [rows]
        for j, group in enumerate(groups):
            best = [max(float(p[i]) for p in group) for i in range(t)]
            for u in range(pages):
                got = scores[r, j, u] if per_kv_head else scores[r, u]
                assert abs(float(got) - sum(best[u * page:(u + 1) * page])) < 1e-5
