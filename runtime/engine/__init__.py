"""The engine: rolecall's static, graph-captured decoder, what users run on a GPU.

==================  ============================================================================
``shape.py``        :class:`ModelShape`: sizes and family switches from a config; :func:`unsupported`
``weights.py``      :class:`Weights`: a model's tensors in the fused layout, RoPE tables
``cache.py``        :class:`StaticCache`: K/V per layer, sized to the requests, left-padded rows
``layers.py``       the decoder's arithmetic, shared by prefill and step
``decoder.py``      :class:`StaticDecoder`: the step runner: the one-token step, its CUDA graphs
                    (capture, replay), the policy's settling
``attention.py``    :class:`DecodeAttention`: the attention operations a policy's step calls (dense,
                    block-sparse, block scores, top-k, the choice beside the step), kernel by kernel
``prefill.py``      chunked SDPA prefill into the cache
``sampling.py``     greedy / temperature / top-k / top-p choice on the device
``generate.py``     :func:`generate`: prefill, steps, stopping, streaming (:func:`prepare`, then
                    :class:`Request`'s ``prefill`` and ``decode``); :class:`Decoders`: the last
                    request's decoder kept for the next
``crossovers.py``   below which context a sparse policy runs the full step (``crossovers.json``)
==================  ============================================================================

The policies' static steps live in their own files (``runtime/policies/<name>.py``); the engine calls them.
What only the evaluation needs of the engine (full attention's logits along a generation, a prefill shared
between policies, lockstep decoding) is in :mod:`rolecall.eval.decoding`.
"""

from rolecall.runtime.engine.attention import DecodeAttention
from rolecall.runtime.engine.cache import StaticCache
from rolecall.runtime.engine.crossovers import NEVER, default_min_context
from rolecall.runtime.engine.decoder import StaticDecoder, pad_left, padding_mask, static_step_of
from rolecall.runtime.engine.generate import Decoders, Generation, Request, generate, prepare
from rolecall.runtime.engine.sampling import Sampling
from rolecall.runtime.engine.shape import SHAPES, ModelShape, unsupported
from rolecall.runtime.engine.weights import Weights, shared_weights

__all__ = ["NEVER", "SHAPES", "DecodeAttention", "Decoders", "Generation", "ModelShape", "Request",
           "Sampling", "StaticCache", "StaticDecoder", "Weights", "default_min_context", "generate",
           "pad_left", "padding_mask", "prepare", "shared_weights", "static_step_of", "unsupported"]
