"""Grammars for structured output: compile a request's `StructuredOutput` once per distinct spec
(xgrammar), and follow each request's position in it with a matcher.

`GrammarCache` owns the model's xgrammar tokenizer info (built on first use: it reads the
tokenizer and walks the vocabulary once; `tokenizer_info` keeps it in Baton's cache directory) and a
bounded LRU of compiled grammars keyed by the spec;
a compile that takes longer than `compile_timeout_s` is refused with ValueError (it finishes in the
background and is kept, so a retry finds it). `GrammarState` is one request's matcher: the engine
advances it with every token the request emits, here or elsewhere (the prefill worker's first
token, the tokens a migrated request already streamed), so the mask of the next step always
follows exactly the output so far. `fill_bitmask` writes one row of the batch's bitmask.

With a reasoning model the grammar applies to the answer only: a `GrammarState` given the
think-end token sequence (`</think>`) starts in REASONING, where every token is free (no bitmask
row), moves to CONSTRAINED when the output so far ends with that sequence, and to DONE when the
grammar terminates. The phase follows from the tokens accepted, in order, and nothing else, so a
decode worker given the prefill worker's first token, or a migrated request's replayed tokens,
reaches exactly the phase the first worker was in.

Refusals (a spec xgrammar cannot compile, a compile over its time limit) raise
`common.protocol.GrammarCompileError`, a ValueError the router answers with 400. `stats` counts
cache hits and misses and keeps a histogram of compile times (`GrammarStats.counts()`, reported in
the worker's stats as `baton:structured_output_*`).
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import importlib.metadata
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common import envs
from common.protocol import COMPILE_SECONDS_BUCKETS, GrammarCompileError, GrammarCounts
from common.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

__all__ = ["GrammarCache", "GrammarPhase", "GrammarState", "GrammarStats", "choice_grammar"]

DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_TIMEOUT_S = 10.0


def _xgrammar():
    """xgrammar, imported at the first structured request: importing it imports transformers
    (about 1 s of CPU), which a worker would otherwise pay at every start for requests that may
    never come (vLLM also sets up its grammar backend at the first structured request)."""
    import xgrammar

    return xgrammar


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # EBNF string literals take JSON's escapes


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices`."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


@dataclass
class GrammarStats:
    """Totals since start (the worker reports them; router.metrics turns them into baton:* series)."""

    compiles: int = 0
    cache_hits: int = 0
    cache_misses: int = 0  # lookups that found nothing compiled (each then compiles, or fails to)
    compile_seconds: tuple[float, ...] = ()  # the latest compile times, newest last (bounded)
    compile_seconds_sum: float = 0.0
    # Compiles per COMPILE_SECONDS_BUCKETS bound (not cumulative; counts() makes them so).
    compile_bucket_counts: list[int] = field(default_factory=lambda: [0] * len(COMPILE_SECONDS_BUCKETS))

    def record_compile(self, seconds: float) -> None:
        self.compiles += 1
        self.compile_seconds_sum += seconds
        slot = bisect.bisect_left(COMPILE_SECONDS_BUCKETS, seconds)
        if slot < len(COMPILE_SECONDS_BUCKETS):
            self.compile_bucket_counts[slot] += 1

    def counts(self) -> GrammarCounts:
        cumulative, total = [], 0
        for n in self.compile_bucket_counts:
            total += n
            cumulative.append(total)
        return GrammarCounts(
            self.cache_hits, self.cache_misses, self.compiles, self.compile_seconds_sum, tuple(cumulative)
        )


class GrammarPhase(enum.Enum):
    REASONING = "reasoning"  # before the think-end tokens: every token is free
    CONSTRAINED = "constrained"  # the grammar decides the next token
    DONE = "done"  # the grammar is complete and its stop token was emitted


class GrammarState:
    """One request's position in its grammar, and its phase (REASONING -> CONSTRAINED -> DONE)."""

    def __init__(
        self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int], reasoning_end: tuple[int, ...] = ()
    ) -> None:
        self.matcher = _xgrammar().GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.reasoning_end = tuple(reasoning_end)
        self.phase = GrammarPhase.REASONING if self.reasoning_end else GrammarPhase.CONSTRAINED
        self._tail: list[int] = []  # the last len(reasoning_end) tokens, while reasoning

    @property
    def constraining(self) -> bool:
        """Whether the grammar decides the next token (the sampler masks this row only then)."""
        return self.phase is GrammarPhase.CONSTRAINED

    def accept(self, token_id: int) -> bool:
        """Advance by a token the request emitted; False when the grammar does not allow it."""
        if self.phase is GrammarPhase.REASONING:
            self._tail = (self._tail + [token_id])[-len(self.reasoning_end) :]
            if tuple(self._tail) == self.reasoning_end:
                self.phase, self._tail = GrammarPhase.CONSTRAINED, []
            return True
        if self.phase is GrammarPhase.DONE:
            return False  # nothing may follow a complete grammar
        accepted = bool(self.matcher.accept_token(token_id))
        if accepted and self.matcher.is_terminated():
            self.phase = GrammarPhase.DONE
        return accepted

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was emitted: the reply is over."""
        return self.phase is GrammarPhase.DONE

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        assert self.constraining, f"a bitmask asked of a grammar in phase {self.phase.name}"
        self.matcher.fill_next_token_bitmask(bitmask, row)


# What xgrammar's tokenizer info is built from, besides the arguments.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def tokenizer_info(model_dir: Path, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the model's tokenizer. Building it reads the tokenizer through
    transformers (about 2 s of CPU here, which every starting worker paid), so it is kept as JSON in
    Baton's cache directory, keyed by the tokenizer files' bytes, the arguments and xgrammar's
    version; a cache that cannot be read or written is rebuilt or skipped."""
    key = hashlib.sha256(
        json.dumps([vocab_size, sorted(stop_token_ids), importlib.metadata.version("xgrammar")]).encode()
    )
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            key.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    path = envs.cache_dir() / "xgrammar" / f"tokenizer-info-{key.hexdigest()[:24]}.json"
    try:
        return _xgrammar().TokenizerInfo.deserialize_json(path.read_text())
    except (OSError, RuntimeError, ValueError):
        pass
    from transformers import AutoTokenizer  # heavy, and needed only when the cache has no entry

    info = _xgrammar().TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(str(model_dir)), vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(info.serialize_json())
        os.replace(partial, path)  # whole or absent for a worker starting beside this one
    except OSError:
        pass
    return info


class GrammarCache:
    """Compiled grammars of one model, by spec (bounded LRU); thread-safe."""

    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        capacity: int = DEFAULT_CACHE_SIZE,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.capacity = capacity
        self.compile_timeout_s = compile_timeout_s
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._times: list[float] = []
        self.stats = GrammarStats()

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            info = tokenizer_info(self.model_dir, self.vocab_size, self.stop_token_ids)
            self._compiler = _xgrammar().GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        started = time.perf_counter()
        try:
            if spec.kind == "json_schema":
                compiled = compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
            elif spec.kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.spec)
            elif spec.kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(json.loads(spec.spec)))
            else:
                compiled = compiler.compile_grammar(spec.spec)
        except RuntimeError as exc:  # xgrammar reports every parse or conversion error so
            raise GrammarCompileError(f"structured output ({spec.kind}) does not compile: {str(exc).strip()}") from None
        seconds = time.perf_counter() - started
        with self._lock:
            self.stats.record_compile(seconds)
            self._times = (self._times + [seconds])[-1000:]
            self.stats.compile_seconds = tuple(self._times)
            self._compiled[spec] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def compiled(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; GrammarCompileError when it is invalid or takes too long."""
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
                self.stats.cache_hits += 1
                return found
            self.stats.cache_misses += 1
        if (
            self._compiler is None
        ):  # the first imports xgrammar and reads the tokenizer (seconds): not counted in the limit
            self._pool.submit(self._get_compiler).result()
        future = self._pool.submit(self._compile, spec)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise GrammarCompileError(
                f"structured output ({spec.kind}) did not compile within {self.compile_timeout_s:g} s"
            ) from None

    def counts(self) -> GrammarCounts:
        """The stats as the worker reports them (taken under the lock: compiles run on their own thread)."""
        with self._lock:
            return self.stats.counts()

    def state(self, spec: StructuredOutput, reasoning_end: tuple[int, ...] = ()) -> GrammarState:
        """A fresh matcher of `spec`; with `reasoning_end`, inactive until the output holds it."""
        return GrammarState(self.compiled(spec), self.stop_token_ids, reasoning_end)
