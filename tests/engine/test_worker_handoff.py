"""Prefill on one worker, KV pushed over shared memory, decode on another: same tokens as one engine.

Runs two EngineWorkers in this process (no Ray): the decode worker reserves blocks, the prefill
worker computes the prompt and pushes its blocks into them, the decode worker continues.
"""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from testkit import workers
from tests.engine.helpers import handoff, worker_pair
from workers.build import load_engine
from workers.config import EngineConfig

pytestmark = pytest.mark.slow
CONFIG = EngineConfig(kv_cache_memory=48 << 20)


@pytest.fixture(scope="module")
def pair(default_model_dir):
    with worker_pair(default_model_dir, CONFIG) as both:
        yield both


def test_handoff_matches_single_engine_and_moves_the_right_blocks(pair, default_model_dir, chat_prompts):
    prefill, decode = pair
    alone = load_engine(default_model_dir, CONFIG)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    for i, prompt in enumerate(chat_prompts[:3]):
        [want] = alone.generate([prompt], params)
        got, result, reservation, _ = handoff(prefill, decode, f"r{i}", prompt, params)
        assert got == want.token_ids
        assert result.num_blocks_sent == len(reservation.block_ids) - reservation.num_cached_tokens // 16
        assert result.bytes_sent == result.num_blocks_sent * decode.engine.runner.kv_cache[:, :, 0].numel() * 4
    # Later prompts share the system prompt: the decode worker reused its own cached blocks.
    assert reservation.num_cached_tokens > 0
    for worker in pair:
        stats = worker.stats()
        assert stats.num_free_blocks == stats.num_blocks


def test_transferred_blocks_equal_the_prefill_workers_blocks(pair, chat_prompts):
    prefill, decode = pair
    prompt = chat_prompts[5]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    reservation = workers.reserve(decode, "bytes", prompt, params)
    result = workers.prefill(prefill, "bytes", prompt, params, decode.endpoint(), reservation)
    # max_tokens=1: the request ends with its first token, nothing is sent, the reservation is freed.
    assert result.output.finished and result.num_blocks_sent == 0
    workers.abort(decode, "bytes")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefill.engine.block_manager.reset_prefix_cache()
    reservation = workers.reserve(decode, "bytes2", prompt, params)
    src_holder = {}
    real_begin_send = prefill.engine.begin_send

    def capture_begin_send(rid):  # runs on the prefill engine thread as the send starts
        src_holder["ids"] = real_begin_send(rid)
        return src_holder["ids"]

    prefill.engine.begin_send = capture_begin_send
    try:
        result = workers.prefill(prefill, "bytes2", prompt, params, decode.endpoint(), reservation)
    finally:
        prefill.engine.begin_send = real_begin_send
    # The blocks go back to the prefix cache after the send, their contents untouched.
    skip = reservation.num_cached_tokens // 16
    src = prefill.engine.runner.kv_cache[:, :, src_holder["ids"][skip:]]
    dst = decode.engine.runner.kv_cache[:, :, reservation.block_ids[skip:]]
    assert torch.equal(src, dst)
    workers.start_decode(decode, "bytes2", result.output.token_ids[0])
    while not any(o.finished for o in decode.poll_outputs(5.0)):
        pass
