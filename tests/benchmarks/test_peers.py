"""The peer the benchmarks time against (``benchmarks/peers.py``): FlashInfer's paged decode over rolecall's cache
computes the same attention as the reference kernel, and the engine's dense step built on it gives full's logits.
On a GPU with ``flashinfer-python`` importable; elsewhere skipped."""

import pytest
import torch

from benchmarks import peers
from rolecall.runtime.kernels.sparse_attention import naive

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not peers.flashinfer_available(), reason="needs flashinfer-python")]


def test_flashinfer_decode_reads_the_pages_its_table_lists():
    b, hkv, g, t, d, page = 2, 4, 4, 1024, 128, 64
    q = torch.randn(b, hkv * g, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = d ** -0.5
    # dense over the first 600 tokens: the last of 10 pages holds 24
    tokens = 600
    run = peers.flashinfer_decode(torch.arange(10, device="cuda").expand(b * hkv, -1), tokens, g, d, page,
                                  torch.bfloat16, scale)
    mask = torch.zeros(b, t, dtype=torch.bool, device="cuda")
    mask[:, :tokens] = True
    want, _ = naive.sparse_decode_attention(q.float(), k.float(), v.float(), scale=scale, key_mask=mask)
    got = run(q, k, v).float()
    assert (got - want).abs().max() < 2e-2
    assert (want - naive.sparse_decode_attention(q.float(), k.float(), v.float(), scale=scale)[0]).abs().max() > 0.1
    # sparse: each (sequence, KV head) its own 3 pages
    blocks = torch.stack([torch.randperm(16, device="cuda")[:3].sort().values for _ in range(b * hkv)])
    run = peers.flashinfer_decode(blocks, 3 * page, g, d, page, torch.bfloat16, scale)
    want, _ = naive.sparse_decode_attention(q.float(), k.float(), v.float(), blocks.view(b, hkv, 3).int(),
                                            scale=scale, block_size=page)
    assert (run(q, k, v).float() - want).abs().max() < 2e-2


def test_the_engine_step_on_flashinfer_gives_fulls_logits():
    from rolecall.runtime.engine import ModelShape, StaticDecoder, Weights

    shape = ModelShape(layers=3, hidden=256, heads=8, kv_heads=2, head_dim=128, intermediate=512, vocab=300)
    weights = Weights.random(shape, device="cuda", dtype=torch.bfloat16, std=0.05, positions=1024)

    def run(policy):  # one step: the peer is planned for the tokens its first step reads
        dec = StaticDecoder(weights, policy, batch=2, max_len=512, min_context=0, compile=False)
        dec.cache.fill_random(seed=1)
        dec.set_length(300)
        return dec.step(torch.full((2,), 7, device="cuda")).float()

    want = run(None)
    got = run(peers.FlashInferFull())
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    with pytest.raises(ValueError, match="sliding-window"):
        peers.FlashInferFull().static_step(ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                                                      intermediate=128, vocab=10, windows=(8, None)))
