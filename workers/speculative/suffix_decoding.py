"""Suffix decoding (as in Arctic Inference and vLLM's `"method": "suffix"`): drafts from the longest
recent match of a sequence's last tokens, in its own prompt and output and in the outputs of
requests this worker finished lately, continued along the most frequent path.

Both sources are `SuffixIndex`es: counts of every run of up to `depth` consecutive tokens (a suffix
trie cut at that depth). Each sequence has its own, extended token by token as it grows (the tokens
since the last step: O(depth) each); the worker's shared one holds the outputs of its last
`max_cached_requests` finished requests (the oldest taken out again). A proposal looks up the
sequence's last m tokens (m as long as the index has them, up to depth - num_speculative_tokens, so
that a match leaves room to continue), then follows from there the child seen most often, while the
product of their frequencies (the path's estimated probability) stays at or above `min_token_prob`,
for at most max_spec_factor x m tokens: a long match earns long drafts, a short one few. The
source with the longer match proposes (its own sequence on a tie).

The shared index is only a hint: a request that migrates to another worker starts from what that
worker has; its own index is rebuilt from its tokens at its first proposal there. The tokens
emitted are never affected: drafts are verified as every method's are (workers.speculative).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from workers.config import SpeculativeConfig
from workers.engine.sequence import ScheduledChunk, Sequence


@dataclass(eq=False)
class _Node:
    count: int = 0  # occurrences of the run of tokens from the root to here
    children: dict[int, _Node] = field(default_factory=dict)


class SuffixIndex:
    """Counts of every run of 1..depth consecutive tokens of the sequences added to it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: list[int]) -> None:
        """Count every run of tokens (a sequence of its own: runs do not cross into others)."""
        self._walk_runs(tokens, +1)

    def remove(self, tokens: list[int]) -> None:
        """Undo add(tokens); runs no sequence has any more are dropped."""
        self._walk_runs(tokens, -1)

    def _walk_runs(self, tokens: list[int], delta: int) -> None:
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += delta
                if child.count <= 0:
                    del node.children[token]
                    break
                node = child

    def extend(self, open_runs: list[_Node], token: int) -> list[_Node]:
        """Count `token` after the runs `open_runs` (those ending at the sequence's last token, by
        length, as the previous call returned them; [] for an empty sequence); returns the runs
        that now end at `token`."""
        runs = []
        for node in [self.root, *open_runs[: self.depth - 1]]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            runs.append(child)
        return runs

    def match(self, context: list[int], longest: int) -> tuple[_Node | None, int]:
        """The node of the longest run of context's last tokens (at most `longest`) that the index has
        seen followed by something, and its length; (None, 0) when none."""
        for length in range(min(longest, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - length :]:
                child = node.children.get(token)
                if child is None:
                    break
                node = child
            else:  # the index has seen the whole run
                if node.children:
                    return node, length
        return None, 0

    @staticmethod
    def continuation(node: _Node, max_tokens: int, min_prob: float) -> list[int]:
        """Follow the most frequent child from `node` while the path's probability stays >= min_prob."""
        drafts: list[int] = []
        prob = 1.0
        while len(drafts) < max_tokens and node.children:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / sum(c.count for c in node.children.values())
            if prob < min_prob:
                break
            drafts.append(token)
            node = child
        return drafts


@dataclass
class _Own:
    """A sequence's own index and how far it has read the sequence's tokens."""

    index: SuffixIndex
    indexed: int = 0
    open_runs: list[_Node] = field(default_factory=list)


class SuffixProposer:
    """workers.speculative.speculator.Proposer for `"method": "suffix"` (see the module docstring)."""

    relative_cost = 0.0
    draws_with_keys = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        # Room to continue after a match: the longest match looked up leaves num_speculative_tokens.
        self.longest_match = max(1, self.depth - config.num_speculative_tokens)
        self.shared = SuffixIndex(self.depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # request id -> output, oldest first
        self._own: dict[str, _Own] = {}

    def drafting_seconds(self, measured: float) -> float:
        return measured  # all of its time is drafting

    def prefill_kv(self, chunks: list[tuple[ScheduledChunk, bool]]) -> None:
        pass  # no KV of its own

    def adopt_prompt(self, seq: Sequence, num_cached_tokens: int) -> None:
        pass  # its index reads the tokens at its first proposal

    def propose_many(self, seqs: list[Sequence], limits: list[int], generators=None) -> list[list[int]]:
        return [self.propose(seq, limit) for seq, limit in zip(seqs, limits)]  # no distribution: keys unused

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        own = self._own.get(seq.request_id)
        if own is None:
            own = self._own[seq.request_id] = _Own(SuffixIndex(self.depth))
        tokens = seq.token_ids
        # The runs ending at the newest token have no next token yet, so a match found in the
        # sequence's own index is an earlier occurrence, with the token that followed it.
        for token in tokens[own.indexed :]:
            own.open_runs = own.index.extend(own.open_runs, token)
        own.indexed = len(tokens)
        best: list[int] = []
        best_length = 0
        for index in (own.index, self.shared):
            node, length = index.match(tokens, self.longest_match)
            if node is None or length <= best_length:
                continue
            limit = min(max_drafts, max(1, math.floor(self.spec_factor * length)))
            drafts = index.continuation(node, limit, self.min_prob)
            if drafts:
                best, best_length = drafts, length
        return best

    def forget(self, seq: Sequence, finished: bool) -> None:
        """The request left this worker: drop its own index; a finished one's output joins the shared
        index (the oldest cached output leaves it past max_cached_requests)."""
        self._own.pop(seq.request_id, None)
        if not finished or not seq.output_token_ids:
            return
        output = list(seq.output_token_ids)
        self._cached[seq.request_id] = output
        self.shared.add(output)
        while len(self._cached) > self.max_cached:
            _, oldest = self._cached.popitem(last=False)
            self.shared.remove(oldest)
