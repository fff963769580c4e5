"""Self-speculative greedy decoding with the model's own MTP layer (model.mtp_layers = 1).

Each main step feeds two tokens per row: the pending token (greedy's next, already decided) and the
MTP layer's draft of the one after it. The main model's logits at the pending token give greedy's
next token; if it equals the draft, the logits at the draft give the token after that as well, so
an accepted draft yields two tokens for one main step, a rejected one yields one. A rejected
draft's cache slot is marked invalid, so no later token sees it and positions count only the
accepted tokens (the left-padding rule of gattn.eval.decode); a Gated DeltaNet layer runs the two
tokens one recurrent step at a time and keeps the state after the last accepted one. The output is
greedy decoding's, token for token (`gattn.eval.decode.generate`): the draft decides only how many
tokens a step yields, never which.

The MTP layer keeps its own kv cache, one slot per main slot: at slot t it reads the main model's
final hidden state h_t and token t+1 and predicts token t+2 (gattn/model/mtp.py). Per step: one
jitted program runs the main model on the two tokens, checks the draft, runs the MTP layer on its
two new inputs (the second invalid when the draft was rejected) and drafts the next token.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.config import ConfigError
from gattn.eval.decode import Stop, _check, _positions, _stopped, init_cache, round_up, to_device, to_host
from gattn.model.transformer import Transformer, head_logits, unscanned


class Stats(NamedTuple):
    """What a speculative decode did: drafts the main model checked and accepted, main steps
    (the prefill not counted), tokens returned, wall-clock seconds."""

    drafts: int
    accepted: int
    steps: int
    tokens: int
    seconds: float

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0

    def as_dict(self) -> dict:
        return {"drafts": self.drafts, "accepted": self.accepted, "acceptance_rate": round(self.acceptance, 4),
                "main_steps": self.steps, "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else None}


def check(model: Transformer) -> None:
    """A ConfigError unless the model has an MTP layer to draft with."""
    if not model.cfg.mtp_layers:
        raise ConfigError("model.mtp_layers", model.cfg.mtp_layers, "1 for speculative decoding with the MTP "
                          "layer (this model has none: decode without --speculative)")


def _logits(model, x_NxD, b, s):
    return head_logits(x_NxD, model.head_weight(), model.dtype).reshape(b, s, -1)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(4, 5))
def _prefill(graphdef, state, tokens_BxS, valid_BxS, cache, mtp_cache):
    """The prompt into both caches: (greedy's first token, the MTP draft of the second, caches)."""
    model = nnx.merge(graphdef, state)
    b, s = tokens_BxS.shape
    positions_BxS = _positions(valid_BxS, cache)
    h_NxD, cache = model.decode_hidden(tokens_BxS, positions_BxS, cache, valid_BxS)
    first_B = jnp.argmax(_logits(model, h_NxD, b, s)[:, -1], axis=-1).astype(jnp.int32)
    after_BxS = jnp.concatenate([tokens_BxS[:, 1:], first_B[:, None]], axis=1)  # token t+1 beside h_t
    mtp_BxSxV, mtp_cache = model.mtp_decode(h_NxD, after_BxS, positions_BxS, mtp_cache, valid_BxS)
    return first_B, jnp.argmax(mtp_BxSxV[:, -1], axis=-1).astype(jnp.int32), cache, mtp_cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(4, 5))
def _step(graphdef, state, pending_B, draft_B, cache, mtp_cache):
    """One main step on [pending, draft] per row: (greedy's next token, the one after it (valid
    where accepted), accepted [B] bool, the next draft, caches)."""
    model = nnx.merge(graphdef, state)
    b = pending_B.shape[0]
    tokens_Bx2 = jnp.stack([pending_B, draft_B], axis=1)
    positions_Bx2 = _positions(jnp.ones((b, 2), bool), cache)
    index = cache["index"]
    h_NxD, cache = model.decode_hidden(tokens_Bx2, positions_Bx2, cache, stepwise=model.cfg.hybrid)
    logits_Bx2xV = _logits(model, h_NxD, b, 2)
    next_B, after_B = (jnp.argmax(logits_Bx2xV[:, i], axis=-1).astype(jnp.int32) for i in (0, 1))
    accepted_B = next_B == draft_B
    cache["valid"] = jax.lax.dynamic_update_slice(cache["valid"], accepted_B[:, None], (0, index + 1))
    if "gdn_each" in cache:  # each GDN layer keeps its state after the last accepted token
        keep = lambda first, second: jnp.where(accepted_B.reshape((b,) + (1,) * (first.ndim - 1)), second, first)  # noqa: E731
        cache["gdn"] = tuple(None if each is None else jax.tree.map(keep, *each) for each in cache.pop("gdn_each"))
    valid_Bx2 = jnp.stack([jnp.ones_like(accepted_B), accepted_B], axis=1)
    mtp_Bx2xV, mtp_cache = model.mtp_decode(h_NxD, jnp.stack([next_B, after_B], axis=1), positions_Bx2,
                                            mtp_cache, valid_Bx2)
    drafts_Bx2 = jnp.argmax(mtp_Bx2xV, axis=-1).astype(jnp.int32)
    draft_B = jnp.where(accepted_B, drafts_Bx2[:, 1], drafts_Bx2[:, 0])
    return next_B, after_B, accepted_B, draft_B, cache, mtp_cache


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             eos_id: int | None = None, stop: Stop = None, max_len: int | None = None,
             pad_multiple: int = 16, with_stats: bool = False):
    """Greedy continuations of `prompts`, as `gattn.eval.decode.generate(..., temperature=0)`
    returns them (same stopping rules), drafted by the MTP layer; with `with_stats`, (outputs,
    Stats). Each main step takes two cache slots, so the cache holds the padded prompt plus
    2 * max_new_tokens slots (`max_len` slots: at least that many; calls of one max_len and
    padded prompt length share their compiled steps)."""
    check(model)
    _check(prompts, max_new_tokens, None)
    t0 = time.perf_counter()
    s = round_up(max(len(p) for p in prompts), pad_multiple)
    need = s + 2 * max_new_tokens
    if max_len is not None and max_len < need:
        raise ValueError(f"max_len = {max_len}: speculative decoding needs the padded prompt ({s}) plus "
                         f"2 * max_new_tokens ({2 * max_new_tokens}) slots, {need}")
    max_len = round_up(need, pad_multiple) if max_len is None else max_len
    tokens_BxS = np.zeros((len(prompts), s), np.int32)
    valid_BxS = np.zeros((len(prompts), s), bool)
    for row, p in enumerate(prompts):
        tokens_BxS[row, s - len(p):] = p
        valid_BxS[row, s - len(p):] = True
    if model.grouped:  # a scanned hybrid: its blocks sliced out of the groups once, not at every step
        model = unscanned(model)
    graphdef, state = nnx.split(model)
    cache, mtp_cache = init_cache(model, len(prompts), max_len), model.init_mtp_cache(len(prompts), max_len)
    pending_B, draft_B, cache, mtp_cache = _prefill(graphdef, state, to_device(tokens_BxS), to_device(valid_BxS),
                                                    cache, mtp_cache)
    generated: list[list[int]] = [[] for _ in prompts]
    outputs: list[list[int] | None] = [None] * len(prompts)

    def take(row: int, token: int) -> None:
        if outputs[row] is None and len(generated[row]) < max_new_tokens:
            generated[row].append(token)
            outputs[row] = _stopped(generated[row], eos_id, stop)

    for row, token in enumerate(to_host(pending_B).tolist()):
        take(row, token)
    drafts = accepted = steps = 0
    while any(o is None and len(g) < max_new_tokens for o, g in zip(outputs, generated)):
        live = [o is None and len(g) < max_new_tokens for o, g in zip(outputs, generated)]
        next_B, after_B, ok_B, draft_B, cache, mtp_cache = _step(graphdef, state, pending_B, draft_B, cache, mtp_cache)
        pending_B = jnp.where(ok_B, after_B, next_B)
        steps += 1
        for row, (n, a, ok) in enumerate(zip(to_host(next_B).tolist(), to_host(after_B).tolist(),
                                             to_host(ok_B).tolist())):
            if live[row]:
                drafts, accepted = drafts + 1, accepted + ok
                take(row, n)
                if ok:
                    take(row, a)
    results = [g if o is None else o for g, o in zip(generated, outputs)]
    if not with_stats:
        return results
    return results, Stats(drafts, accepted, steps, sum(map(len, results)), time.perf_counter() - t0)
