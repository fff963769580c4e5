"""lm-evaluation-harness (lm-eval) over any gattn run: the model class `gattn`.

    python -m gattn.lm_eval --model_args workdir=RUN --tasks hellaswag,arc_easy [lm-eval's flags]
    python eval.py --workdir RUN --lm-eval hellaswag,arc_easy [--data-dir DIR]   (RUN/eval/lm_eval.json)
    lm_eval.api.registry.get_model("gattn").create_from_arg_string("workdir=RUN")  (after importing this)

`workdir` is a gattn run directory (its latest checkpoint, or `step=N`) or a Hugging Face model
folder, converted in memory by gattn.interop.convert. Model arguments: workdir, step, batch_size
(rows per forward pass, default 8), max_length (default the run's train.seq_len), max_gen_toks
(default 256, or half of max_length if that is less), overrides (gattn config overrides,
`;`-separated, as eval.py's --config.FIELD=VALUE).

How each request type runs:
  loglikelihood          requests that share a context (a question's choices) are laid out as the
                         context once and each choice after it, a segment that also sees the
                         context (prefix ids); contexts that begin alike (few-shot examples) share
                         those tokens too (Family); these are packed several per row (segment
                         ids, positions restarting per group) into rows of one of a few fixed
                         lengths (64, 128, ..., max_length) and batches of `batch_size` rows: a
                         task compiles a handful of times, not once per request. The logits are
                         formed only at the scored positions, a chunk at a time, never [rows,
                         length, vocabulary]. A request longer than max_length loses tokens from
                         the left of its context, as lm-eval's hf backend does. A MoE scores
                         dropless whatever its capacity factor (`dropless`), as decoding runs it:
                         with a capacity, the tokens packed together would compete for expert
                         slots, and a request's score would depend on its neighbours.
  loglikelihood_rolling  lm-eval's own disjoint windows (the ones its hf backend scores), through
                         the same packed scorer.
  generate_until         greedy decoding with the kv cache (gattn.eval.decode), stopped at the EOS
                         id or any non-empty `until` string (`stop_strings`), prompts batched
                         longest first; sampling is refused.

Tokens: a run trained with data.bos opens every context with BOS (the hf backend's add_bos_token);
an empty context is BOS, or EOS for a run without BOS (gattn's documents follow an EOS).

Several processes (a slice, or `python -m gattn.launch`): every process holds its shards of the
model; process 0 runs the harness and broadcasts each batch of work, and every process runs the
same computation on the global arrays (`follow`). An expert-parallel MoE runs as the partitioned
one (`off_mesh`), as eval.py measures it. The batches are the same for any number of processes, so
the results are too.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from gattn.config import ConfigError
from gattn.eval import decode
from gattn.interop.runs import load  # noqa: F401 (harness.load: what the model class reads)
from gattn.model.transformer import Transformer, head_logits, off_mesh, with_exec

SHORTEST_ROW = 64  # row lengths: SHORTEST_ROW * 2^k, capped at max_length
TOKEN_CHUNK = 1024  # tokens whose logits are formed at once
SHARED_PREFIX = 16  # contexts that begin with this many tokens in common share them (Family)
_LIVE: list["GattnLM"] = []  # process 0's model, told to release the followers when the harness ends


def row_length(longest: int, max_length: int) -> int:
    """The fixed row length for requests of at most `longest` tokens."""
    n = SHORTEST_ROW
    while n < longest:
        n *= 2
    return min(n, max_length)


def pack(lengths: list[int], row: int) -> list[list[int]]:
    """Item indices per row (best fit, longest first: each item goes to the fullest row it fits
    in): each row holds items whose lengths sum to at most `row`. Deterministic, O(n log n)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at < len(free):
            room, r = free.pop(at)
        else:
            room, r = row, len(rows)
            rows.append([])
        rows[r].append(i)
        bisect.insort(free, (room - lengths[i], r))
    return rows


class Group(NamedTuple):
    """Requests that share a context, laid out as the context once and then each continuation's
    inputs (all but its last token) as a segment that also sees the context (prefix ids). The
    first token of every continuation is predicted at the context's last token. `members`:
    (request index, continuation) pairs."""

    context: list[int]
    members: list[tuple[int, list[int]]]

    @property
    def length(self) -> int:
        return len(self.context) + sum(len(cont) - 1 for _, cont in self.members)


def group(items: list[tuple[int, list[int], list[int]]], max_length: int, share: bool) -> list[Group]:
    """(request index, context, continuation) triples as Groups of at most `max_length` tokens:
    requests with the same context tokens share it (`share`), else each is a group alone."""
    by_context: dict[tuple, list] = {}
    for i, ctx, cont in items:  # (a one-token context, a rolling window's first, is not worth sharing)
        by_context.setdefault(tuple(ctx) if share and len(ctx) > 1 else (i,), []).append((i, ctx, cont))
    groups = []
    for members in by_context.values():
        current = Group(members[0][1], [])
        for i, _, cont in members:
            if current.members and current.length + len(cont) - 1 > max_length:
                groups.append(current)
                current = Group(current.context, [])
            current.members.append((i, cont))
        groups.append(current)
    return groups


class Family(NamedTuple):
    """Groups whose contexts begin with the same `prefix` tokens (the few-shot examples that every
    question of an MMLU subject repeats), laid out as the prefix once, then each group's rest of
    context and its choices, which also see the prefix (prefix ids). A family of one group has
    no prefix: the group alone."""

    prefix: list[int]
    groups: list[Group]

    @property
    def length(self) -> int:
        return len(self.prefix) + sum(g.length - len(self.prefix) for g in self.groups)


def families(groups: list[Group], share: bool) -> list[Family]:
    """The groups in families (`share`; else each alone): in the order of their contexts, a group
    joins the family before it while the contexts' common prefix stays at least SHARED_PREFIX
    tokens (it always leaves each group one token of its own: the one that predicts the choices'
    first tokens)."""
    if not share:
        return [Family([], [g]) for g in groups]
    out: list[tuple[list[int], list[Group]]] = []  # (the prefix common so far, groups)
    for g in sorted(groups, key=lambda g: g.context):
        if out:
            common, members = out[-1]
            n = 0
            limit = min(len(common), len(g.context) - 1)
            while n < limit and common[n] == g.context[n]:
                n += 1
            if n >= SHARED_PREFIX:
                members.append(g)
                out[-1] = (common[:n], members)
                continue
        out.append((g.context[:-1], [g]))
    return [Family(common if len(members) > 1 else [], members) for common, members in out]


def chunk(family: Family, length: int) -> list[Family]:
    """`family` cut into families of at most `length` tokens, each with its own copy of the prefix."""
    out, current = [], Family(family.prefix, [])
    for g in family.groups:
        if current.groups and current.length + g.length - len(family.prefix) > length:
            out.append(current)
            current = Family(family.prefix, [])
        current.groups.append(g)
    out.append(current)
    return [f if len(f.groups) > 1 else Family([], f.groups) for f in out]


def choose_rows(fams: list[Family], rows: int, max_length: int) -> tuple[int, list[Family], list[list[int]]]:
    """(row length, families cut to it, layout: indices into them per row): of the row lengths
    SHORTEST_ROW * 2^k from the longest group's up to max_length, the one that packs the families
    into the fewest token slots, counted in whole batches of `rows` rows (the shorter on a tie)."""
    best = None
    length = row_length(max(g.length for f in fams for g in f.groups), max_length)
    while True:
        pieces = [piece for f in fams for piece in chunk(f, length)]
        layout = pack([f.length for f in pieces], length)
        cells = -(-len(layout) // rows) * rows * length
        if best is None or cells < best[0]:
            best = (cells, length, pieces, layout)
        if length >= max_length:
            return best[1:]
        length = min(2 * length, max_length)


class Packed(NamedTuple):
    """One batch of packed requests: token ids, positions and segment ids ([rows, length] int32),
    prefix ids ([rows, length, K]: the segments a token also sees; None when nothing is shared),
    and the scored positions (flat indices into the rows, padded with 0) with their target tokens
    ([P] int32)."""

    tokens: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    prefixes: np.ndarray | None
    where: np.ndarray
    targets: np.ndarray


def _bucket(n: int, cap: int) -> int:
    """How many scored positions the batches compute: n rounded up to a multiple of 128 (at most
    cap, never below n)."""
    return max(min(-(-n // 128) * 128, cap), n)


@functools.partial(jax.jit, static_argnums=0)
def _score(graphdef, state, batch: Packed):
    """(log p(target), target is the argmax) at the batch's scored positions ([P] each); the logits
    only there, at most TOKEN_CHUNK positions at a time (float32)."""
    model = nnx.merge(graphdef, state)
    x_NxD, _ = model.hidden(batch.tokens, batch.positions, batch.segments, prefix_ids_BxSxK=batch.prefixes)
    x_PxD = jnp.take(x_NxD, batch.where, axis=0)
    p = x_PxD.shape[0]
    size = -(-p // -(-p // TOKEN_CHUNK))  # the fewest chunks of at most TOKEN_CHUNK, evenly
    pad = -p % size
    x_CxKxD = jnp.pad(x_PxD, ((0, pad), (0, 0))).reshape(-1, size, x_PxD.shape[-1])
    t_CxK = jnp.pad(batch.targets, (0, pad)).reshape(-1, size)
    head = model.head_weight()

    def one(args):
        x_KxD, t_K = args
        logits_KxV = head_logits(x_KxD, head, model.dtype)
        target_K = jnp.take_along_axis(logits_KxV, t_K[:, None], axis=-1)[:, 0]
        logp_K = target_K - jax.nn.logsumexp(logits_KxV, axis=-1)
        return logp_K, jnp.argmax(logits_KxV, axis=-1) == t_K

    logp, greedy = jax.lax.map(one, (x_CxKxD, t_CxK))
    return logp.reshape(-1)[:p], greedy.reshape(-1)[:p]


def dropless(model: Transformer) -> Transformer:
    """The same parameters with a dropless MoE (model.moe.capacity_factor None; a dense or
    dropless model as it is): what cached decoding runs (gattn/model/moe.py). With a capacity,
    each expert keeps the first C of a forward pass's tokens, so a request's log-likelihood would
    depend on the requests and padding packed with it."""
    moe = model.cfg.moe
    if moe is None or moe.capacity_factor is None:
        return model
    cfg = dataclasses.replace(model.cfg, moe=dataclasses.replace(moe, capacity_factor=None))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, model.ex, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def stop_strings(until, eos_text: str | None) -> list[str]:
    """A request's stop strings as lm-eval's backends form them (`handle_stop_sequences`: `until`
    and the decoded EOS), less empty ones: '' is in every text, so it would stop every row after
    one token, and a SentencePiece EOS (gattn's own runs) decodes to ''. Generation stops at the
    EOS by its id whatever it decodes to (`Scorer.generate`), as the hf backend's does."""
    return [s for s in handle_stop_sequences(until, eos=eos_text) if s]


class Scorer:
    """The model's side of the harness: packed log-likelihoods and greedy generation on token ids,
    the same on every process (their inputs are global arrays: `decode.to_device`)."""

    def __init__(self, model, tokenizer, max_length: int):
        self.model = dropless(with_exec(model, off_mesh(model.ex)))  # (no mesh is set here)
        self.graphdef, self.state = nnx.split(self.model)
        self.tokenizer, self.max_length = tokenizer, max_length
        self.share = not model.cfg.hybrid  # a Gated DeltaNet layer cannot share a context (Transformer.hidden)

    def score(self, batch: Packed) -> tuple[np.ndarray, np.ndarray]:
        """One packed batch: (log p(target), target is the argmax) at its scored positions."""
        logp, greedy = _score(self.graphdef, self.state, Packed(*(None if a is None else decode.to_device(a)
                                                                 for a in batch)))
        return decode.to_host(logp), decode.to_host(greedy)

    def loglikelihood(self, requests: list[tuple[list[int], list[int]]], rows: int,
                      score=None) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation)
        per (context, continuation) pair of token ids; `score` runs each packed batch (default
        `self.score`). Requests with the same context compute it once (a multiple-choice
        question's choices), unless the model has Gated DeltaNet layers."""
        score = score or self.score
        out: list[tuple[float, bool]] = [(0.0, True)] * len(requests)  # (nothing to score: a lone token)
        items = []
        for i, (ctx, cont) in enumerate(requests):
            if not cont:
                raise ValueError("loglikelihood: an empty continuation has no tokens to score")
            seq = (list(ctx) + list(cont))[-(self.max_length + 1):]
            n = min(len(cont), len(seq) - 1)  # the scored tokens: the continuation, or what fits of it
            if n:
                items.append((i, seq[:-n], seq[-n:]))
        if not items:
            return out
        fams = families(group(items, self.max_length, self.share), self.share)
        length, fams, layout = choose_rows(fams, rows, self.max_length)
        batches = [[[fams[f] for f in row] for row in layout[start:start + rows]]
                   for start in range(0, len(layout), rows)]
        # One number of scored positions and of prefix ids for every batch of the call: one compile.
        scored = _bucket(max(sum(len(cont) for row in batch for f in row for g in f.groups for _, cont in g.members)
                             for batch in batches), rows * length)
        depth = 2 if any(f.prefix for f in fams) else int(any(len(g.members) > 1 for f in fams for g in f.groups))
        for batch in batches:
            batch, spans = self._lay_out(batch, rows, length, scored, depth)
            logp, greedy = score(batch)
            for i, (a, b) in spans.items():
                out[i] = (float(logp[a:b].astype(np.float64).sum()), bool(greedy[a:b].all()))
        return out

    @staticmethod
    def _lay_out(rows_of_families: list[list[Family]], rows: int, length: int, scored: int,
                 depth: int) -> tuple[Packed, dict]:
        """The Packed batch of these rows (`scored` positions, `depth` prefix ids per token: 0 for
        none), and each request's span of scored positions in it."""
        tokens, positions, segments = np.zeros((3, rows, length), np.int32)
        prefixes = np.zeros((rows, length, 2), np.int32)
        where, targets, spans = [], [], {}

        def put(r, at, ids, start, seg, seen):
            """Lays `ids` out at row r from `at`, positions from `start`, in segment `seg`, also
            seeing segments `seen`; returns where the next token goes."""
            end = at + len(ids)
            tokens[r, at:end], positions[r, at:end], segments[r, at:end] = ids, range(start, start + len(ids)), seg
            prefixes[r, at:end, :len(seen)] = seen
            return end

        for r, fams in enumerate(rows_of_families):
            at, seg = 0, 0
            for f in fams:
                p, family_seg = len(f.prefix), 0
                if f.prefix:
                    seg = family_seg = seg + 1
                    at = put(r, at, f.prefix, 0, seg, [])
                above = [family_seg] if family_seg else []
                for g in f.groups:
                    c, seg = len(g.context), seg + 1
                    at = put(r, at, g.context[p:], p, seg, above)
                    last, context_seg = r * length + at - 1, seg
                    for i, cont in g.members:
                        m = len(cont) - 1  # the continuation's inputs: all but its last token
                        if len(g.members) > 1:  # a choice: a segment that sees its context (and the family's prefix)
                            seg += 1
                            put(r, at, cont[:-1], c, seg, [context_seg] + above)
                        else:
                            put(r, at, cont[:-1], c, context_seg, above)
                        spans[i] = (len(where), len(where) + m + 1)
                        where += [last] + list(range(r * length + at, r * length + at + m))
                        targets += cont
                        at += m
        pad = scored - len(where)
        return Packed(tokens, positions, segments, prefixes[..., :depth] if depth else None,
                      np.asarray(where + [0] * pad, np.int32), np.asarray(targets + [0] * pad, np.int32)), spans

    def generate(self, prompts: list[list[int]], until: list[str], max_tokens: int, eos: int | None) -> list[str]:
        """Greedy continuations (text), each stopped at the `eos` id or cut before the first
        `until` string (empty ones are ignored: `stop_strings`). The padded prompt length is a
        multiple of a quarter of the power of two below the longest prompt (at least 16): four
        lengths per octave, so batches of similar lengths reuse one compiled prefill and step,
        and padding adds at most a quarter."""
        until = [s for s in until if s]

        def stop(tokens):
            text = self.tokenizer.decode(tokens)
            return any(s in text for s in until)

        longest = max(len(p) for p in prompts)
        tokens = decode.generate(self.model, prompts, max_new_tokens=max_tokens, eos_id=eos,
                                 stop=stop if until else None, pad_multiple=max(16, 2 ** (longest.bit_length() - 3)))
        return [postprocess_generated_text(self.tokenizer.decode(t), until, None) for t in tokens]


@register_model("gattn")
class GattnLM(TemplateLM):
    """A gattn run as an lm-eval model (module docstring)."""

    def __init__(self, workdir: str, step: int | None = None, batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int | None = None, overrides: str = "",
                 loaded: tuple | None = None, **extra):
        super().__init__()
        # lm-eval adds its own max_batch_size and device (JAX places the model); any other key is a
        # --model_args typo, which would otherwise be dropped (e.g. stpe=2000 scoring the latest step)
        for key in sorted(set(extra) - {"max_batch_size", "device"}):
            raise ConfigError("--model_args", key, "one of workdir, step, batch_size, max_length, max_gen_toks, "
                              "overrides (docs/evaluation.md)")
        if str(batch_size).startswith("auto"):
            batch_size = 8
        self.rows = int(batch_size)
        if jax.process_count() > 1:  # the followers load when process 0 does (its restore is collective)
            if jax.process_index() == 0:
                _client().key_value_set("gattn/harness/load", "1")
            else:
                _client().blocking_key_value_get("gattn/harness/load", WAIT_MS)
        # `loaded`: (cfg, model, tokenizer, step) a caller has restored already (eval.py --tasks)
        cfg, model, self.gattn_tokenizer, self.step = loaded or load(
            workdir, None if step is None else int(step), [o for o in str(overrides).split(";") if o])
        self.cfg, self.workdir = cfg, str(workdir)
        self.max_len = int(max_length) if max_length else cfg.train.seq_len
        self.max_gen_toks = int(max_gen_toks) if max_gen_toks else min(256, self.max_len // 2)
        for name, value in (("batch_size", self.rows), ("max_gen_toks", self.max_gen_toks), ("max_length", self.max_len)):
            if value < 1:
                raise ConfigError(name, value, "a positive integer")
        self.scorer = Scorer(model, self.gattn_tokenizer, self.max_len)
        eos = self.gattn_tokenizer.eos_id()
        self.eos = None if eos is None or eos < 0 else int(eos)
        self.bos = self.gattn_tokenizer.bos_id() if cfg.data.bos else None
        if jax.process_index() == 0:
            _LIVE.append(self)

    # ------------------------------------------------------------------ what lm-eval asks of a model
    @property
    def eot_token_id(self) -> int:
        if self.eos is None:
            raise ConfigError("data.tokenizer", self.workdir, "a tokenizer with an end-of-text token "
                              "(lm-eval's requests end in it)")
        return self.eos

    @property
    def prefix_token_id(self) -> int:
        return self.bos if self.bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.max_len

    @property
    def tokenizer_name(self) -> str:
        return str(self.cfg.data.tokenizer or self.workdir)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.gattn_tokenizer.encode(string)
        return [self.bos] + ids if self.bos is not None and add_special_tokens is not False else ids

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.gattn_tokenizer.decode([tokens] if isinstance(tokens, int) else tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = self.scorer.loglikelihood([(c, x) for _, c, x in requests], self.rows, score=self._score)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string, add_special_tokens=False), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=True)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owners, scores):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode(self.eos) if self.eos is not None else None
        groups: dict[tuple, list[int]] = {}  # rows of one batch share their stop strings and length
        prompts = []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ConfigError("generation_kwargs", {k: gen_kwargs.get(k) for k in ("do_sample", "temperature")},
                                  "greedy decoding (do_sample false, temperature 0): gattn's harness model "
                                  "does not sample")
            until = stop_strings(kwargs.pop("until", None), eos_text)
            max_tokens = int(kwargs.pop("max_gen_toks"))
            if max_tokens >= self.max_length:
                raise ConfigError("max_gen_toks", max_tokens, f"below max_length ({self.max_length})")
            prompts.append(self.tok_encode(context)[-(self.max_length - max_tokens):])
            groups.setdefault((tuple(until), max_tokens), []).append(i)
        out = [""] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for (until, max_tokens), members in groups.items():
            members.sort(key=lambda i: -len(prompts[i]))  # a batch's prompts of similar lengths: little padding
            for start in range(0, len(members), self.rows):
                rows = members[start:start + self.rows]
                texts = self._run("generate", {"prompts": [prompts[i] for i in rows], "until": list(until),
                                               "max_tokens": max_tokens})
                for i, text in zip(rows, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(rows))
        bar.close()
        return out

    # ------------------------------------------------------------------ every process, the same work
    def _run(self, kind: str, payload: dict):
        """Does `kind` of work on every process (process 0 tells the others first)."""
        message = {"kind": kind, **payload}
        if jax.process_count() > 1:
            _send(message)
        return self._execute(message)

    def _score(self, batch: Packed):
        if jax.process_count() == 1:
            return self.scorer.score(batch)
        return self._run("score", {"batch": [None if a is None else a.tolist() for a in batch]})

    def _execute(self, m: dict):
        if m["kind"] == "score":
            batch = Packed(*(None if a is None else np.asarray(a, np.int32) for a in m["batch"]))
            return self.scorer.score(batch)
        if m["kind"] == "generate":
            return self.scorer.generate(m["prompts"], m["until"], m["max_tokens"], self.eos)
        raise ValueError(f"unknown harness message {m['kind']!r}")

    def follow(self) -> None:
        """A process other than 0: does the work process 0 sends, until it says stop."""
        while (m := _receive())["kind"] != "stop":
            self._execute(m)

    def release(self) -> None:
        """Process 0, when the harness is done: lets the followers go."""
        if jax.process_count() > 1 and jax.process_index() == 0:
            _send({"kind": "stop"})


# Messages from process 0. A follower waits for each in JAX's key-value store, which has no
# deadline (process 0 may spend minutes between two batches: building a task's prompts, running
# HumanEval's tests), and then takes it in a collective broadcast, which has one.
_sent = [0]
WAIT_MS = 7 * 24 * 3600 * 1000


def _client():
    from jax._src import distributed  # noqa: PLC0415

    return distributed.global_state.client


def _send(message: dict) -> None:
    from gattn.train import hosts  # noqa: PLC0415

    _sent[0] += 1
    _client().key_value_set(f"gattn/harness/{_sent[0]}", "1")
    hosts.broadcast_json(message)


def _receive() -> dict:
    from gattn.train import hosts  # noqa: PLC0415

    _sent[0] += 1
    _client().blocking_key_value_get(f"gattn/harness/{_sent[0]}", WAIT_MS)
    return hosts.broadcast_json(None)


def release_all() -> None:
    while _LIVE:
        _LIVE.pop().release()


def evaluate(workdir: str | Path, tasks: list[str], *, step: int | None = None, overrides: list[str] = (),
             num_fewshot: int | None = None, limit: int | None = None, batch_size: int = 8,
             data_dir: str | Path | None = None, allow_code: bool = False,
             out_dir: str | Path | None = None) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` on `workdir`'s checkpoint; writes lm_eval.json (lm-eval's
    results, configs and versions, and which checkpoint) and lm_eval.md (its table) to `out_dir`
    (default WORKDIR/eval). `data_dir`: the local benchmark files of the local_* tasks."""
    import lm_eval as harness_lib  # noqa: PLC0415
    from lm_eval.tasks import TaskManager  # noqa: PLC0415
    from lm_eval.utils import make_table  # noqa: PLC0415

    from gattn.eval import code_eval, lm_tasks  # noqa: PLC0415

    folder = lm_tasks.write(data_dir, tempfile.mkdtemp(prefix="gattn-tasks-")) if data_dir else None
    local = {c.get("group") or c["task"] for c in lm_tasks.tasks(data_dir).values()} if data_dir else set()
    for task in tasks:
        if task not in local and (task.startswith(lm_tasks.PREFIX) or task == lm_tasks.TABLE4):
            raise ConfigError("--lm-eval", task, "one of gattn's local tasks (gattn/eval/lm_tasks.py)" + (
                "" if data_dir else "; they need --data-dir"))
    # lm-eval's own index of its ~15,000 tasks takes most of a minute: only when a task needs it.
    manager = TaskManager(include_path=str(folder) if folder else None,
                          include_defaults=not set(tasks) <= local)
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            raise ConfigError("--lm-eval", task, "a task or group lm-eval knows")
    if data_dir:
        lm_tasks.check_files(tasks, data_dir)
    if allow_code:
        os.environ[code_eval.ENV] = "1"
    lm = GattnLM(workdir=str(workdir), step=step, batch_size=batch_size, overrides=";".join(overrides))
    results = harness_lib.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                          task_manager=manager, confirm_run_unsafe_code=allow_code)
    out = {"workdir": str(workdir), "step": lm.step, "variant": lm.cfg.variant, "tasks": list(tasks),
           "num_fewshot": num_fewshot, "limit": limit, **json_safe(results)}
    out_dir = Path(out_dir) if out_dir else Path(workdir) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lm_eval.json").write_text(json.dumps(out, indent=1))
    table = make_table(results) + ("\n" + make_table(results, "groups") if results.get("groups") else "")
    (out_dir / "lm_eval.md").write_text(table)
    out["table"] = table
    return out


def json_safe(results: dict) -> dict:
    """lm-eval's results dict without what JSON cannot hold (samples, functions, numpy scalars)."""
    drop = {"samples"}
    return json.loads(json.dumps({k: v for k, v in results.items() if k not in drop}, default=_plain))


def _plain(x):
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)
