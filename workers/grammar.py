"""Grammars for structured output: compile a request's `StructuredOutput` once per distinct spec
(xgrammar), and follow each request's position in it with a matcher.

`GrammarCache` owns the model's xgrammar tokenizer info (built on first use: it reads the
tokenizer and walks the vocabulary once) and a bounded LRU of compiled grammars keyed by the spec;
a compile that takes longer than `compile_timeout_s` is refused with ValueError (it finishes in the
background and is kept, so a retry finds it). `GrammarState` is one request's matcher: the engine
advances it with every token the request emits, here or elsewhere (the prefill worker's first
token, the tokens a migrated request already streamed), so the mask of the next step always
follows exactly the output so far. `fill_bitmask` writes one row of the batch's bitmask.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar as xgr

from common.sampling_params import StructuredOutput

__all__ = ["GrammarCache", "GrammarState", "GrammarStats", "choice_grammar"]

DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_TIMEOUT_S = 10.0


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
    compile_seconds: tuple[float, ...] = ()  # the latest compile times, newest last (bounded)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled: "xgr.CompiledGrammar", stop_token_ids: list[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)

    def accept(self, token_id: int) -> bool:
        """Advance by a token the request emitted; False when the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was emitted: the reply is over."""
        return bool(self.matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCache:
    """Compiled grammars of one model, by spec (bounded LRU); thread-safe."""

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int],
                 capacity: int = DEFAULT_CACHE_SIZE, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.capacity = capacity
        self.compile_timeout_s = compile_timeout_s
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._times: list[float] = []
        self.stats = GrammarStats()

    def _get_compiler(self) -> "xgr.GrammarCompiler":
        if self._compiler is None:
            from transformers import AutoTokenizer  # heavy, and only structured requests need it

            tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, spec: StructuredOutput) -> object:
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
            raise ValueError(f"structured output ({spec.kind}) does not compile: {str(exc).strip()}") from None
        seconds = time.perf_counter() - started
        with self._lock:
            self.stats.compiles += 1
            self._times = (self._times + [seconds])[-1000:]
            self.stats.compile_seconds = tuple(self._times)
            self._compiled[spec] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def compiled(self, spec: StructuredOutput) -> object:
        """The compiled grammar of `spec`; ValueError when it is invalid or takes too long."""
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
                self.stats.cache_hits += 1
                return found
        if self._compiler is None:  # the first one reads the tokenizer (seconds): not counted in the limit
            self._pool.submit(self._get_compiler).result()
        future = self._pool.submit(self._compile, spec)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise ValueError(f"structured output ({spec.kind}) did not compile within "
                             f"{self.compile_timeout_s:g} s") from None

    def state(self, spec: StructuredOutput) -> GrammarState:
        return GrammarState(self.compiled(spec), self.stop_token_ids)
