"""The next-token loss: exec.loss_chunk computes the same loss, gradients and validation sums as
the plain loss, while the compiled loss + gradient holds far less memory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn.config import ConfigError, ExecConfig
from gattn.model.transformer import Transformer, with_exec
from gattn.train.loss import lm_loss, lm_nll_sum

from conftest import tiny_model

B, S = 2, 19  # 18 targets per row: chunks of 4 leave a partial last chunk


def packed_batch():
    """Two rows: three documents and padding in the first, one document in the second."""
    tokens = jax.random.randint(jax.random.key(0), (B, S), 0, 61)
    seg = jnp.asarray([[1] * 7 + [2] * 5 + [3] * 4 + [0] * 3, [1] * S])
    pos = jnp.asarray([list(range(7)) + list(range(5)) + list(range(4)) + [0] * 3, list(range(S))])
    return tokens, seg, pos


def models(chunk, cfg=None, **exec_changes):
    """(plain, chunked): the same parameters, exec.loss_chunk 0 and `chunk`."""
    ex = ExecConfig(**exec_changes)
    plain = Transformer(cfg or tiny_model(), ex, rngs=nnx.Rngs(0))
    return plain, with_exec(plain, dataclasses.replace(ex, loss_chunk=chunk))


@pytest.mark.parametrize("chunk, tied, dtype", [(4, False, "float32"), (6, True, "bfloat16")])
def test_chunked_loss_and_gradients_equal_the_plain_ones(chunk, tied, dtype):
    """A chunk that leaves a padded last chunk of the 18 targets per row (4) and one that divides
    them (6); packed documents with padding; a separate or a tied LM head; float32, or bf16 compute
    (the chunk's logits take the plain head's dtypes: bf16 inputs, float32 logits)."""
    plain, chunked = models(chunk, tiny_model(tie_embeddings=tied), dtype=dtype)
    batch = packed_batch()

    @nnx.jit
    def both(plain, chunked):  # one compile for both models
        grad = nnx.value_and_grad(lambda m: lm_loss(m, *batch))
        return grad(plain), grad(chunked), lm_loss(plain, batch[0]), lm_loss(chunked, batch[0])

    (loss_p, grads_p), (loss_c, grads_c), unpacked_p, unpacked_c = both(plain, chunked)
    np.testing.assert_allclose(loss_c, loss_p, rtol=1e-6)
    np.testing.assert_allclose(unpacked_c, unpacked_p, rtol=1e-6)  # no segment ids: every target counts
    for g_c, g_p in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads_p), strict=True):
        if dtype == "float32":
            np.testing.assert_allclose(g_c, g_p, rtol=1e-5, atol=1e-7)
        else:  # bf16 weight gradients are rounded per chunk: a few bf16 ulps apart
            assert np.linalg.norm(g_c - g_p) <= 1e-2 * np.linalg.norm(g_p)


def test_chunked_validation_sums_equal_the_plain_ones():
    """(With a chunk longer than the rows: one chunk.)"""
    plain, chunked = models(64)
    (sum_p, n_p), (sum_c, n_c) = nnx.jit(lambda p, c: (lm_nll_sum(p, *packed_batch()),
                                                       lm_nll_sum(c, *packed_batch())))(plain, chunked)
    assert int(n_c) == int(n_p) == 6 + 4 + 3 + 18
    np.testing.assert_allclose(sum_c, sum_p, rtol=1e-6)


def temp_bytes(model, tokens):
    """Temporary bytes of the compiled loss + gradient (what XLA allocates besides arguments and
    outputs: the logits and their gradient live here)."""
    graphdef, params = nnx.split(model, nnx.Param)
    step = jax.jit(jax.value_and_grad(lambda p, t: lm_loss(nnx.merge(graphdef, p), t)))
    return step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_chunked_loss_compiles_to_a_fraction_of_the_memory():
    """At V = 32768 the logits dominate: 2 x 256 targets x 32768 x 4 B = 64 MiB of float32 logits
    (and as much again for their gradient) become 8 MiB chunks."""
    cfg = tiny_model(vocab_size=32768, num_layers=1)
    plain, chunked = models(32, cfg)
    tokens = jnp.zeros((2, 257), jnp.int32)
    plain_b, chunked_b = temp_bytes(plain, tokens), temp_bytes(chunked, tokens)
    assert plain_b > 64 * 2**20, plain_b
    assert chunked_b < plain_b / 4, (plain_b, chunked_b)


@pytest.mark.parametrize("value", [-1, 2.5, True, "8"])
def test_loss_chunk_must_be_a_non_negative_integer(value):
    with pytest.raises(ConfigError, match="loss_chunk"):
        ExecConfig(loss_chunk=value)
