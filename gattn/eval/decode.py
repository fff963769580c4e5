"""Generation with a kv cache, batched over prompts of different lengths: greedy, or sampled.

Prompts are left-padded to a common length: pad slots are invalid cache slots that no token sees,
and positions count only real tokens, so every row computes what it would alone. One jitted
prefill runs the prompts; one jitted step then feeds each row's last token until every row has
stopped. `generate_without_cache` reruns the full forward pass per token: the reference.

Choosing the next token: greedy (temperature 0, the default) takes the argmax. Sampling
(temperature > 0) divides the logits by the temperature, keeps the nucleus (the most probable
tokens whose probabilities, summed from the largest, first reach top_p; top_p = 1 keeps every
token) and draws from it. Row r's draw at step i uses fold_in(fold_in(key, r), i): the same key
gives the same tokens, and a row draws what it would alone in row r of any batch.

Stopping, per row, checked after each new token: `eos_id` (the eos itself is not returned);
`stop` as a list of token sequences (the output ends before the first one it ends with); or
`stop` as a callable on the tokens generated so far (they are returned up to and including the
token on which it returned True).

Exact for every variant with a dropless MoE (or none): with a capacity factor, which tokens an
expert drops depends on how many tokens run together, so a cached step and the full pass differ.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.config import ConfigError
from gattn.model.transformer import Transformer, unscanned

Stop = Callable[[list[int]], bool] | Sequence[Sequence[int]] | None


def init_cache(model: Transformer, batch: int, max_len: int) -> dict:
    """An empty cache for `batch` rows of `max_len` slots (layout: Transformer.init_cache); with
    several processes, a global array replicated over every device."""
    if jax.process_count() == 1:
        cache = model.init_cache(batch, max_len)
        sharding = getattr(model.embed[...], "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):  # as the prefill returns it: one compile, not two
            cache = jax.device_put(cache, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
        return cache
    return jax.jit(lambda: model.init_cache(batch, max_len), out_shardings=_replicated())()


def _replicated():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

    return NamedSharding(Mesh(np.asarray(jax.devices()), ("all",)), PartitionSpec())


def to_device(x) -> jax.Array:
    """A host array as a jit input: with several processes (each giving the same value), a global
    array replicated over every device, as a model whose parameters span the processes needs."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return jnp.asarray(x)
    return jax.make_array_from_callback(x.shape, _replicated(), lambda index: x[index])


def to_host(x) -> np.ndarray:
    """A jit output as a numpy array on every process."""
    if jax.process_count() == 1 or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _positions(valid_BxS, cache):
    """Each new token's position: the real tokens before it in its row (pads get 0)."""
    before_Bx1 = jnp.sum(cache["valid"], axis=1, keepdims=True, dtype=jnp.int32)
    return jnp.maximum(before_Bx1 + jnp.cumsum(valid_BxS, axis=1, dtype=jnp.int32) - 1, 0)


class Sampling(NamedTuple):
    """How a sampled token is drawn (device arrays, so new values reuse the compiled step): each
    row's key data `keys_Bx2` (`row_keys`), the temperature and top_p (float32 scalars)."""

    keys_Bx2: jax.Array
    temperature: jax.Array
    top_p: jax.Array


MIN_TEMPERATURE = 1e-6  # logits / T stay finite in float32 for |logits| up to ~3e32


def check_sampling(temperature: float, top_p: float, names: tuple[str, str] = ("temperature", "top_p")) -> None:
    """A ConfigError naming `names` unless temperature >= 0 and 0 < top_p <= 1 (finite numbers)."""
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)  # noqa: E731
    # (a positive temperature below MIN_TEMPERATURE overflows float32 logits / T to inf: NaN
    # probabilities, and the lowest ids drawn; before, 1e-39 gave [1, 1, 1, ...])
    if not number(temperature) or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ConfigError(names[0], temperature, f"0 (greedy decoding, the argmax at every step) or a number >= "
                          f"{MIN_TEMPERATURE:g}")
    if not number(top_p) or not 0 < top_p <= 1:
        raise ConfigError(names[1], top_p, "a number in (0, 1] (the probability mass sampled from; 1: every token)")


def row_keys(key: jax.Array, rows: int) -> np.ndarray:
    """[rows, 2] uint32 (a threefry key's data): row r's key fold_in(key, r), from a typed key
    (jax.random.key) or a raw one (jax.random.PRNGKey)."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    return np.asarray(jax.random.key_data(jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(rows))))


def _nucleus(logits_BxV: jax.Array, top_p: jax.Array) -> jax.Array:
    """The logits with every token outside its row's nucleus at -inf: the nucleus is the tokens
    whose probabilities, summed from the largest, first reach top_p (the top token always; ties
    at the cut stay in)."""
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    p_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    above_BxV = jnp.cumsum(p_BxV, axis=-1) - p_BxV  # the mass of the tokens more probable than each
    kept_B = jnp.sum(above_BxV < top_p, axis=-1)  # >= 1: nothing is above the top token
    cut_Bx1 = jnp.take_along_axis(sorted_BxV, kept_B[:, None] - 1, axis=-1)
    return jnp.where((logits_BxV >= cut_Bx1) | (top_p >= 1), logits_BxV, -jnp.inf)


def _pick(logits_BxV: jax.Array, sampling: Sampling | None, step: jax.Array) -> jax.Array:
    """The next token per row [B] int32: the argmax (`sampling` None), or a draw (module docstring)."""
    if sampling is None:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = _nucleus(logits_BxV.astype(jnp.float32) / sampling.temperature, sampling.top_p)
    keys_B = jax.vmap(lambda k: jax.random.fold_in(jax.random.wrap_key_data(k), step))(sampling.keys_Bx2)
    return jax.vmap(jax.random.categorical)(keys_B, logits_BxV).astype(jnp.int32)


_first = jax.jit(_pick)  # the first new token, from the prefill's logits


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)  # the cache is updated in place
def _prefill(graphdef, state, tokens_BxS, valid_BxS, cache):
    model = nnx.merge(graphdef, state)
    return model.decode(tokens_BxS, _positions(valid_BxS, cache), cache, valid_BxS)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _step(graphdef, state, tokens_B, cache, sampling, step):
    """Feeds one token per row; returns the next token per row (`_pick`, the `step`-th new one)
    and the cache. Compiled once per shape for greedy decoding (`sampling` None) and once for
    sampling, whatever the temperature, top_p and key."""
    model = nnx.merge(graphdef, state)
    valid_Bx1 = jnp.ones((tokens_B.shape[0], 1), bool)
    logits_Bx1xV, cache = model.decode(tokens_B[:, None], _positions(valid_Bx1, cache), cache)
    return _pick(logits_Bx1xV[:, 0], sampling, step), cache


def prefill(model: Transformer, tokens_BxS, valid_BxS, cache: dict, *, chunk: int | None = None,
            last_only: bool = False):
    """(logits, cache): runs a block of tokens (False in `valid_BxS` = padding) into the cache
    after what it holds (the cache passed in is consumed: use the one returned). With `chunk`,
    `chunk` tokens at a time: each layer then holds one [chunk, cache length] attention matrix
    per head instead of [S, cache length], so a long prompt fits in memory; the result is the
    same. Logits are [B, S, V], or [B, V] of the last position with `last_only` (a long prompt's
    [S, V] logits are themselves large)."""
    graphdef, state = nnx.split(model)
    tokens_BxS, valid_BxS = np.asarray(tokens_BxS), np.asarray(valid_BxS, bool)
    s = tokens_BxS.shape[1]
    chunk = s if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"prefill chunk = {chunk}: expected >= 1")
    pieces = []
    for start in range(0, s, chunk):
        logits, cache = _prefill(graphdef, state, to_device(tokens_BxS[:, start:start + chunk]),
                                 to_device(valid_BxS[:, start:start + chunk]), cache)
        pieces.append(logits[:, -1] if last_only else logits)
    if last_only:
        return pieces[-1], cache
    return (pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)), cache


def _stopped(tokens: list[int], eos_id: int | None, stop: Stop) -> list[int] | None:
    """The row's output if the tokens generated so far end it, else None."""
    if eos_id is not None and tokens[-1] == eos_id:
        return tokens[:-1]
    if callable(stop):
        return tokens if stop(tokens) else None
    for seq in stop or ():
        if seq and tokens[-len(seq):] == list(seq):
            return tokens[:-len(seq)]
    return None


def _check(prompts, max_new_tokens: int, max_len: int | None) -> int:
    """The cache length (max_len, or just enough), after checking the request."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: expected >= 1")
    need = max(len(p) for p in prompts) + max_new_tokens
    if max_len is not None and need > max_len:
        raise ValueError(f"the longest prompt ({max(len(p) for p in prompts)} tokens) plus "
                         f"max_new_tokens ({max_new_tokens}) is {need} > max_len ({max_len})")
    return need if max_len is None else max_len


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n (padded lengths that reuse compilations)."""
    return -(-n // multiple) * multiple


def _sampling(rows: int, temperature: float, top_p: float, key: jax.Array | None) -> Sampling | None:
    """The checked sampling settings as device arrays; None for greedy decoding."""
    check_sampling(temperature, top_p)
    if temperature == 0:
        return None
    if key is None:
        raise ConfigError("key", None, "a jax PRNG key (jax.random.key(seed)) when temperature > 0 (sampling)")
    return Sampling(to_device(row_keys(key, rows)), to_device(np.float32(temperature)), to_device(np.float32(top_p)))


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             eos_id: int | None = None, stop: Stop = None, max_len: int | None = None,
             pad_multiple: int = 16, prefill_chunk: int | None = None, temperature: float = 0.0,
             top_p: float = 1.0, key: jax.Array | None = None) -> list[list[int]]:
    """Continuation of each prompt (at most `max_new_tokens` tokens, stopped as the module
    docstring says), batched with a kv cache of `max_len` slots: greedy, or with temperature > 0
    drawn from the top_p nucleus with `key` (module docstring). The padded prompt length and the
    default max_len are rounded up to a multiple of `pad_multiple`, so that calls with similar
    lengths reuse the compiled prefill and step. `prefill_chunk` runs the prompts `prefill_chunk`
    tokens at a time (memory-bounded prefill for long prompts; the prompt length is then padded
    to a multiple of it where the cache allows). A scanned hybrid decodes as its layer loop, its
    blocks sliced from the stacked groups once for the call: one more copy of the block weights
    while it runs, instead of one written at every step."""
    _check(prompts, max_new_tokens, max_len)
    for name, value in (("pad_multiple", pad_multiple), ("prefill_chunk", prefill_chunk)):
        if value is not None and (not isinstance(value, int) or value < 1):  # (before: ZeroDivisionError)
            raise ConfigError(name, value, "an integer >= 1" + (", or None (one pass)" if name == "prefill_chunk" else ""))
    vocab = model.cfg.vocab_size
    if (bad := next((t for p in prompts for t in p if not 0 <= t < vocab), None)) is not None:
        raise ConfigError("prompts", bad, f"token ids in [0, {vocab}), the model's vocabulary")  # (before: read as 0)
    sampling = _sampling(len(prompts), temperature, top_p, key)
    s = max(len(p) for p in prompts)
    if prefill_chunk is not None and prefill_chunk < s:
        pad_multiple = prefill_chunk
    if max_len is None:
        max_len = round_up(s + max_new_tokens, pad_multiple)
    s = min(round_up(s, pad_multiple), max_len - max_new_tokens)
    tokens_BxS = np.zeros((len(prompts), s), np.int32)
    valid_BxS = np.zeros((len(prompts), s), bool)
    for row, p in enumerate(prompts):
        tokens_BxS[row, s - len(p):] = p
        valid_BxS[row, s - len(p):] = True
    if model.grouped:  # its blocks sliced from the stacked groups once, not at every step (Transformer.layers)
        model = unscanned(model)
    graphdef, state = nnx.split(model)
    cache = init_cache(model, len(prompts), max_len)
    logits_BxV, cache = prefill(model, tokens_BxS, valid_BxS, cache, chunk=prefill_chunk, last_only=True)
    next_B = _first(logits_BxV, sampling, to_device(np.int32(0)))
    generated = [[] for _ in prompts]
    outputs: list[list[int] | None] = [None] * len(prompts)
    for step in range(max_new_tokens):
        for row, token in enumerate(to_host(next_B).tolist()):
            if outputs[row] is None:
                generated[row].append(token)
                outputs[row] = _stopped(generated[row], eos_id, stop)
        if all(o is not None for o in outputs) or step == max_new_tokens - 1:
            break
        next_B, cache = _step(graphdef, state, next_B, cache, sampling, to_device(np.int32(step + 1)))
    return [g if o is None else o for g, o in zip(generated, outputs)]


@functools.partial(jax.jit, static_argnums=0)
def _forward_last(graphdef, state, tokens_1xL, length, sampling, step):
    """The next token after the first `length` tokens (`_pick`), by the full forward pass (the
    slots after them are padding: segment id 0, and causal attention keeps them out of the rest)."""
    segment_ids_1xL = (jnp.arange(tokens_1xL.shape[1]) < length).astype(jnp.int32)[None]
    logits_1xLxV = nnx.merge(graphdef, state)(tokens_1xL, None, segment_ids_1xL)
    return _pick(logits_1xLxV[:, length - 1], sampling, step)[0]


def generate_without_cache(model: Transformer, prompts: Sequence[Sequence[int]], *,
                           max_new_tokens: int, eos_id: int | None = None, stop: Stop = None,
                           max_len: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                           key: jax.Array | None = None) -> list[list[int]]:
    """`generate` by the plain forward pass: each row alone, the whole sequence rerun for every new
    token (slow; the reference the cached path is tested against)."""
    max_len = _check(prompts, max_new_tokens, max_len)
    sampling = _sampling(len(prompts), temperature, top_p, key)
    graphdef, state = nnx.split(model)
    results = []
    for row, p in enumerate(prompts):
        row_sampling = None if sampling is None else sampling._replace(keys_Bx2=sampling.keys_Bx2[row:row + 1])
        generated: list[int] = []
        out = None
        while out is None and len(generated) < max_new_tokens:
            seq = list(p) + generated
            tokens_1xL = jnp.asarray([seq + [0] * (max_len - len(seq))], jnp.int32)
            generated.append(int(_forward_last(graphdef, state, tokens_1xL, len(seq), row_sampling,
                                               np.int32(len(generated)))))
            out = _stopped(generated, eos_id, stop)
        results.append(generated if out is None else out)
    return results
