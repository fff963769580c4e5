"""`python -m gattn.prepare`: a corpus tokenized once into ArrayRecord shards, on Apache Beam.

    python -m gattn.prepare --source DIR --tokenizer tokenizer.json --out SHARDS [--workers 2]
    python train.py --config dense_1p7b --config.data.source=shards:SHARDS ...

The corpus is read as training reads it (gattn/data/corpus.py: a folder of .txt / .jsonl files,
one such file, or "embedded"; gs:// through etils.epath), with the same held-out rule
(`corpus.Document.split`, balanced per domain as `corpus.balance` does). Each document's ids,
exactly those the text path encodes from it (`tokenizer.document_encoder`: `tokenizer.encode` of
the whole text, for a tokenizer.json with special tokens' text read as text), are stored as one
record.
The runner is Beam's: the DirectRunner with --workers local processes by default; any other Beam
option (e.g. --runner=DataflowRunner ...) goes to Beam as it is (docs/training.md#real-corpora).
A document's file and its place in it depend only on its id, so any number of workers writes the
same bytes. The manifest is written last, by this process, once the corpus has passed the corpus
checks.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import PurePosixPath

from etils import epath

from gattn.config import ConfigError
from gattn.data import corpus, shards
from gattn.data.tokenizer import document_encoder, read_tokenizer

STATS = ".stats.json"  # the workers' per-file numbers, read back to write the manifest
_ERROR = "gattn data error: "  # marks a corpus error raised inside a Beam worker


def inputs(source: str) -> list[tuple[str, str]]:
    """(file, its path under the corpus folder) for every .txt / .jsonl file of `source` (a
    folder, or one such file), sorted; "embedded" gives [("embedded", "")]."""
    if source == corpus.EMBEDDED:
        return [(corpus.EMBEDDED, "")]
    root = epath.Path(source).expanduser()
    expected = "expected 'embedded', a folder of .txt / .jsonl files or one such file"
    if root.is_file() and root.suffix in (".txt", ".jsonl"):
        return [(str(root), root.name)]
    if not root.is_dir():
        raise corpus.DataError(f"--source={source!r}", "no such folder or .txt / .jsonl file", expected)
    files = sorted(folder / name for folder, _, names in root.walk() for name in names  # (gs:// has no rglob)
                   if name.endswith((".txt", ".jsonl")))
    if not files:
        raise corpus.DataError(f"--source={source!r}", "the folder holds no .txt or .jsonl files", expected)
    return [(str(p), str(p.relative_to(root))) for p in files]


def read_documents(item: tuple[str, str], decode_errors: str, code_max_bytes: int):
    """One input file's documents as (id, domain, text, replaced bytes)."""
    path, rel = item
    try:
        docs = (corpus.embedded_documents(code_max_bytes) if path == corpus.EMBEDDED
                else corpus.file_documents(epath.Path(path), PurePosixPath(rel), decode_errors))
        for doc in docs:
            yield doc.id, doc.domain, doc.text, doc.replaced_bytes
    except ConfigError as e:  # crosses Beam's worker boundary as text: the driver prints it as one line
        raise RuntimeError(_ERROR + str(e)) from None


def shard_of(doc_id: str, num_shards: int) -> int:
    """The file a document goes to: bytes of its id's hash that the held-out rule does not read."""
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[8:16], 16) % num_shards


class Encode:
    """A Beam DoFn body: a document -> ((split, domain or "", shard), (id, domain, ids, bytes,
    replaced, digest)); the tokenizer is read once per worker. The ids are the whole document's,
    as the text path encodes it (`document_encoder`; `max_chars`: the pieces of gattn's own
    SentencePiece models, cut only where that changes no id)."""

    def __init__(self, tokenizer_file: str, num_shards: int, max_chars: int):
        self.tokenizer_file, self.num_shards, self.max_chars = tokenizer_file, num_shards, max_chars
        self.encode = None

    def __call__(self, doc, moved=()):
        import numpy as np  # noqa: PLC0415

        if self.encode is None:
            self.encode = document_encoder(read_tokenizer(epath.Path(self.tokenizer_file), "--tokenizer"),
                                           self.max_chars)
        doc_id, domain, text, replaced = doc
        ids = np.asarray(self.encode(text), np.int32)
        split = corpus.Document(doc_id, domain, "", moved=doc_id in moved).split
        digest = hashlib.sha256(hashlib.sha256(json.dumps([doc_id, domain]).encode()).digest()
                                + hashlib.sha256(text.encode()).digest()).digest()
        key = (split, domain if split == "validation" else "", shard_of(doc_id, self.num_shards))
        yield key, (doc_id, domain, ids.tobytes(), len(text.encode()), replaced, digest)


def _encode(doc, encode: Encode, moved: list[str]):
    yield from encode(doc, moved)  # (Beam passes a side input to a function, not to a callable object)


def _tally(doc) -> tuple:
    return doc[1], corpus.tally(doc[0])  # (domain, the document's share of its tally)


def _moved(domain_tally) -> list[str]:
    return corpus.moved_ids(domain_tally[1])


def write_shard(keyed, out: str, num_shards: int) -> dict:
    """Writes one file (its documents sorted by id) and returns its numbers for the manifest."""
    import numpy as np  # noqa: PLC0415
    from array_record.python.array_record_module import ArrayRecordWriter  # noqa: PLC0415

    (split, domain, shard), docs = keyed
    docs = sorted(docs, key=lambda d: d[0])
    name = shards.file_name(split, domain, shard, num_shards)
    counts: dict = {}
    digest_sum, tokens = 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, name)
        writer = ArrayRecordWriter(local, "group_size:1")
        for doc_id, doc_domain, ids, nbytes, replaced, digest in docs:
            writer.write(shards.encode_record(doc_domain, np.frombuffer(ids, np.int32)))
            c = counts.setdefault(doc_domain, {"documents": 0, "bytes": 0, "tokens": 0, "replaced_bytes": 0})
            c["documents"] += 1
            c["bytes"] += nbytes
            c["tokens"] += len(ids) // 4 + 1  # + EOS, as training reads it
            c["replaced_bytes"] += replaced
            digest_sum += int.from_bytes(digest, "big")
            tokens += len(ids) // 4 + 1
        writer.close()
        data = open(local, "rb").read()
    (epath.Path(out) / name).write_bytes(data)
    return {"path": name, "split": split, "domain": domain, "records": len(docs), "tokens": tokens,
            "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "counts": counts,
            "digest_sum": f"{digest_sum % 2**256:064x}"}


def write_stats(files: list, out: str) -> None:
    (epath.Path(out) / STATS).write_text(json.dumps(sorted(files, key=lambda f: f["path"])))


def pipeline(p, files: list, tokenizer_file: str, out: str, num_shards: int, max_chars: int,
             decode_errors: str, code_max_bytes: int):
    """The Beam graph: files -> documents -> ids -> one file per (split, domain, shard) -> stats;
    beside it, each domain's tally of ids -> the documents whose split moves (`corpus.balance`)."""
    import apache_beam as beam  # noqa: PLC0415

    docs = (p
            | "files" >> beam.Create(files)
            | "read" >> beam.FlatMap(read_documents, decode_errors, code_max_bytes))
    moved = (docs
             | "tally" >> beam.Map(_tally)
             | "per domain" >> beam.CombinePerKey(corpus.merge)
             | "moved" >> beam.FlatMap(_moved))
    return (docs
            | "encode" >> beam.FlatMap(_encode, Encode(tokenizer_file, num_shards, max_chars),
                                       beam.pvalue.AsList(moved))
            | "group" >> beam.GroupByKey()
            | "write" >> beam.Map(write_shard, out, num_shards)
            | "collect" >> beam.combiners.ToList()
            | "stats" >> beam.Map(write_stats, out))


def beam_options(workers: int, extra: list[str]):
    """Beam's options: the DirectRunner with `workers` local processes (one: in this process),
    unless `extra` names another runner."""
    from apache_beam.options.pipeline_options import PipelineOptions  # noqa: PLC0415

    args = list(extra)
    if not any(a.startswith("--runner") for a in args):
        args += ["--runner=DirectRunner", f"--direct_num_workers={workers}",
                 f"--direct_running_mode={'multi_processing' if workers > 1 else 'in_memory'}"]
    return PipelineOptions(args + ["--default_sdk_harness_log_level=WARNING"])


def copy_tokenizer(tokenizer: str, out: epath.Path) -> epath.Path:
    """The tokenizer file in OUT/tokenizer/ (a tokenizer.json with the tokenizer_config.json
    beside it, where its EOS and BOS are named): the shards and their tokenizer travel together."""
    src = epath.Path(tokenizer).expanduser()
    if not src.is_file():
        raise ConfigError("--tokenizer", tokenizer, "expected an existing Hugging Face tokenizer.json or "
                          "SentencePiece .model file")
    read_tokenizer(src, "--tokenizer")  # (refused in one line if it does not read)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    dst = out / "tokenizer" / src.name
    dst.write_bytes(src.read_bytes())
    config = src.with_name("tokenizer_config.json")
    if src.suffix == ".json" and config.is_file():
        (out / "tokenizer" / config.name).write_bytes(config.read_bytes())
    return dst


def manifest(source: str, files: list, tokenizer_file: epath.Path, out: epath.Path, num_shards: int,
             max_chars: int) -> dict:
    """The manifest from the workers' numbers; the corpus checks of training (`corpus.check`) first."""
    tok = read_tokenizer(tokenizer_file, "--tokenizer")
    domains: dict = {}
    for f in files:
        for domain, c in f["counts"].items():
            splits = domains.setdefault(domain, {s: dict.fromkeys(corpus.COUNTS, 0) for s in corpus.SPLITS.values()})
            for k in corpus.COUNTS:
                splits[corpus.SPLITS[f["split"]]][k] += c[k]
    total = {s: {k: sum(d[s][k] for d in domains.values()) for k in corpus.COUNTS} for s in corpus.SPLITS.values()}
    stats = {d: [s["train"]["documents"], s["held_out"]["documents"], s["train"]["bytes"] + s["held_out"]["bytes"]]
             for d, s in domains.items()}
    replaced = [sum(c["replaced_bytes"] for f in files for c in f["counts"].values()),
                sum(1 for f in files for c in f["counts"].values() if c["replaced_bytes"])]
    documents = sum(f["records"] for f in files)
    digest = sum(int(f["digest_sum"], 16) for f in files) % 2**256
    fingerprint = hashlib.sha256(f"{documents}:{digest:064x}".encode()).hexdigest()[:12]
    corpus.check(source, fingerprint, stats, replaced)
    return {
        "format": shards.FORMAT, "source": source, "source_fingerprint": fingerprint,
        "fingerprint_rule": "sha256 of the document count and the sum (mod 2^256) of each document's "
                            "sha256(sha256(json([id, domain])) + sha256(text))",
        "tokenizer": str(tokenizer_file.relative_to(out)), "tokenizer_sha256": hashlib.sha256(
            tokenizer_file.read_bytes()).hexdigest(), "tokenizer_pieces": tok.get_piece_size(),
        "eos_id": tok.eos_id(), "bos_id": tok.bos_id(), "max_chars": max_chars, "num_shards": num_shards,
        "held_out_rule": corpus.HELD_OUT_RULE,
        "tokens_are": "each document's ids + EOS",
        "counts": {"domains": dict(sorted(domains.items())), "total": total},
        "files": [{k: f[k] for k in ("path", "split", "domain", "records", "tokens", "bytes", "sha256")}
                  for f in files],
    }


def prepare(source: str, tokenizer: str, out: str, *, workers: int = 1, num_shards: int = 16,
            max_chars: int = corpus.MAX_CHARS, decode_errors: str = "strict", code_max_bytes: int = 1_500_000,
            beam_args: list[str] = (), quiet: bool = False) -> dict:
    """Runs the pipeline and writes OUT/manifest.json; returns the manifest and the wall time."""
    import apache_beam as beam  # noqa: PLC0415

    if workers < 1 or num_shards < 1 or max_chars < 1:
        bad = next((n, v) for n, v in (("--workers", workers), ("--num-shards", num_shards),
                                       ("--max-chars", max_chars)) if v < 1)
        raise ConfigError(*bad, "expected an integer >= 1")
    if code_max_bytes < 0:  # (before: -1 was taken and the code domain left out without a word)
        raise ConfigError("--code-max-bytes", code_max_bytes, "an integer >= 0 (0: no code; as data.code_max_bytes)")
    files = inputs(source)
    root = epath.Path(out).expanduser()
    if root.exists() and not root.is_dir():  # (before: NotADirectoryError)
        raise ConfigError("--out", out, "a folder (new or empty) for the shards; this is a file")
    if root.exists() and any(root.iterdir()):
        raise ConfigError("--out", out, "an empty or new folder (the shards of one corpus and tokenizer); "
                          "this one holds files already")
    root.mkdir(parents=True, exist_ok=True)
    tokenizer_file = copy_tokenizer(tokenizer, root)
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    start = time.perf_counter()
    try:
        with _workers_log(workers > 1 and not any(a.startswith("--runner") for a in beam_args)), \
                beam.Pipeline(options=beam_options(workers, list(beam_args))) as p:
            pipeline(p, files, str(tokenizer_file), str(root), num_shards, max_chars, decode_errors, code_max_bytes)
    except Exception as e:  # a worker's corpus error, as one line
        text = str(e)
        if _ERROR not in text:
            raise
        line = text[text.index(_ERROR) + len(_ERROR):].splitlines()[0].strip().strip("'\"")
        raise corpus.DataError(f"--source={source!r}", line, "fix the file, or drop it from the corpus") from None
    seconds = time.perf_counter() - start
    stats = root / STATS
    made = json.loads(stats.read_text())
    m = manifest(source, made, tokenizer_file, root, num_shards, max_chars)
    (root / shards.MANIFEST).write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    stats.unlink()
    if not quiet:
        print(summary(m, str(root), workers, seconds), file=sys.stderr, flush=True)
    return {"manifest": m, "seconds": seconds}


@contextlib.contextmanager
def _workers_log(local_workers: bool):
    """Local worker processes log their start-up at INFO on the stderr they inherit: while they
    run, this process's stderr goes to a file, printed only if the pipeline fails otherwise than
    with a corpus error (which is said in one line)."""
    if not local_workers:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        except Exception as e:
            os.dup2(saved, 2)
            log.seek(0)
            if _ERROR not in str(e):
                sys.stderr.write(log.read().decode(errors="replace")[-5000:])
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def summary(m: dict, where: str, workers: int, seconds: float) -> str:
    """The per-domain table (documents and tokens of the training and held-out splits) and a line
    on the run."""
    total = m["counts"]["total"]
    docs = total["train"]["documents"] + total["held_out"]["documents"]
    tokens = total["train"]["tokens"] + total["held_out"]["tokens"]
    table = corpus.describe({"data_source": m["source"], **m["counts"], "tokens_are": m["tokens_are"]},
                            f"{where}/{shards.MANIFEST}")
    return (table + f"\n  held out: {total['held_out']['documents']:,} of {docs:,} documents "
            f"({100 * total['held_out']['documents'] / max(docs, 1):.1f}%)\n"
            f"  {len(m['files'])} files, {tokens:,} tokens in {seconds:.1f} s with {workers} Beam "
            f"worker(s) ({tokens / max(seconds, 1e-9):,.0f} tokens/s); train with "
            f"--config.data.source=shards:{where}")


def main(argv=None) -> int:
    """The command line (gattn/prepare.py runs it with one-line errors); --json prints the
    manifest's counts and the time on stdout."""
    parser = argparse.ArgumentParser(prog="python -m gattn.prepare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     epilog="Other options (--runner=..., --project, ...) go to Apache Beam.")
    parser.add_argument("--source", required=True, help="'embedded', a folder of .txt / .jsonl files, or one such file (gs:// allowed)")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json (with its tokenizer_config.json beside it) or a SentencePiece .model")
    parser.add_argument("--out", required=True, help="a new folder for the shards and manifest.json (gs:// allowed)")
    parser.add_argument("--workers", type=int, default=1, help="local Beam worker processes (DirectRunner)")
    parser.add_argument("--num-shards", type=int, default=16, help="training files (and per held-out domain at most as many)")
    parser.add_argument("--max-chars", type=int, default=corpus.MAX_CHARS, help="longest piece of text encoded at once, where that changes no id (gattn's "
                        "SentencePiece models); other tokenizers encode each document whole")
    parser.add_argument("--decode-errors", choices=("strict", "replace"), default="strict", help="as data.decode_errors")
    parser.add_argument("--code-max-bytes", type=int, default=1_500_000, help="as data.code_max_bytes (--source embedded)")
    parser.add_argument("--json", action="store_true", help="print the counts and the time as JSON on stdout")
    args, beam_args = parser.parse_known_args(argv)
    done = prepare(args.source, args.tokenizer, args.out, workers=args.workers, num_shards=args.num_shards,
                   max_chars=args.max_chars, decode_errors=args.decode_errors,
                   code_max_bytes=args.code_max_bytes, beam_args=beam_args)
    if args.json:
        m = done["manifest"]
        print(json.dumps({"out": args.out, "workers": args.workers, "seconds": round(done["seconds"], 3),
                          "source_fingerprint": m["source_fingerprint"], "counts": m["counts"],
                          "files": len(m["files"])}))
    return 0
