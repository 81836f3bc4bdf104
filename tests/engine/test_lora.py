"""LoRA adapters in the engine against transformers + peft: three adapters of different ranks and
targets, mixed in one continuous batch with base-model requests, give peft's greedy tokens; a
prompt under two adapters never shares a prefix block; bad adapters are refused by name."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from common.lora import LoRAModuleSpec, parse_lora_modules
from common.request import RequestContext
from common.sampling_params import SamplingParams
from testkit.tensor_parallel import drain
from tests.engine.helpers import hf_greedy, save_lora_adapter, save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.lora.adapter import load_adapter
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig

peft = pytest.importorskip("peft")

# name -> (rank, alpha, targets)
ADAPTERS = {
    "attn-r4": (4, 8, ["q_proj", "v_proj"]),
    "mlp-r8": (8, 16, ["gate_proj", "up_proj", "down_proj"]),
    "all-r16": (16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def served():
    folder, hf = save_tiny_model("llama", tie_word_embeddings=False)
    root = Path(tempfile.mkdtemp(prefix="baton-lora-"))
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        save_lora_adapter(hf, root / name, rank, alpha, targets, seed)
    yield folder, hf, root
    shutil.rmtree(root, ignore_errors=True)


def _peft_model(hf, root: Path, name: str):
    return peft.PeftModel.from_pretrained(hf, str(root / name)).eval()


def _engine(
    folder: str, root: Path, max_loras: int = 3, max_cpu_loras: int | None = None, speculative_config: str | None = None
):
    modules = "\n".join(f"{n}={root / n}" for n in ADAPTERS)
    config = EngineConfig(
        num_kv_blocks=128,
        max_num_batched_tokens=48,
        enable_lora=True,
        lora_modules=modules,
        max_loras=max_loras,
        max_lora_rank=16,
        max_cpu_loras=max_cpu_loras,
        speculative_config=speculative_config,
    )
    return build_engine(ModelConfig.from_model_dir(folder), config, iter_safetensors(folder))


def _run(engine, jobs: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [
        engine.add_request(prompt, params, context=RequestContext(f"r{i}", adapter=adapter))
        for i, (adapter, prompt) in enumerate(jobs)
    ]
    return drain(engine, ids)


def _references(hf, root: Path, jobs: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    refs = []
    with torch.inference_mode():
        for adapter, prompt in jobs:
            if adapter is None:
                refs.append(hf_greedy(hf, prompt, NEW_TOKENS).token_ids)
            else:
                model = _peft_model(hf, root, adapter)
                refs.append(hf_greedy(model, prompt, NEW_TOKENS).token_ids)
                model.unload()
    return refs


def test_three_adapters_and_the_base_in_one_batch_match_peft(served):
    folder, hf, root = served
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(20)]
    # One prompt under every adapter and the base (a shared prefix that must never be shared across
    # them), plus prompts of their own; a 70-token prompt is prefilled in chunks of 48.
    jobs: list[tuple[str | None, list[int]]] = [(a, shared) for a in (None, *ADAPTERS)]
    jobs += [(a, [rng.randrange(3, 512) for _ in range(n)]) for a, n in zip((*ADAPTERS, None), (5, 70, 17, 33))]
    engine = _engine(folder, root)
    ours = _run(engine, jobs)
    refs = _references(hf, root, jobs)
    assert ours == refs
    # The adapters change the output (else the test could not fail).
    assert len({tuple(t) for (_, p), t in zip(jobs, ours) if p == shared}) == 4


def test_fewer_slots_than_adapters_swaps_them_and_still_matches(served):
    folder, hf, root = served
    rng = random.Random(9)
    jobs: list[tuple[str | None, list[int]]] = [
        (a, [rng.randrange(3, 512) for _ in range(12)]) for a in (*ADAPTERS, None, *ADAPTERS)
    ]
    # One device slot and one adapter in host memory: each step runs one adapter beside the base,
    # the others wait, and adapters move in and out of the slot and are read from disk again.
    engine = _engine(folder, root, max_loras=1, max_cpu_loras=1)
    ours = _run(engine, jobs)
    assert ours == _references(hf, root, jobs)
    stats = engine.runner.lora.stats
    assert stats.slot_loads >= len(ADAPTERS) and stats.disk_loads >= len(ADAPTERS) - 1


def test_a_prompt_under_two_adapters_never_shares_a_prefix_block(served):
    folder, _, root = served
    engine = _engine(folder, root)
    prompt = list(range(3, 3 + 64))  # four full blocks
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cached = {}
    for i, adapter in enumerate(("attn-r4", "mlp-r8", None, "attn-r4")):
        rid = engine.add_request(prompt, params, context=RequestContext(f"p{i}", adapter=adapter))
        while True:
            outs = [o for o in engine.step() if o.request_id == rid and o.finished]
            if outs:
                cached[i] = outs[0].num_cached_tokens
                break
    # Only the same adapter's second request finds its blocks.
    assert cached == {0: 0, 1: 0, 2: 0, 3: 48}


def test_unknown_and_bad_adapters_are_refused_by_name(served):
    folder, hf, root = served
    engine = _engine(folder, root)
    with pytest.raises(ValueError, match="'nope' is not served"):
        engine.add_request([5, 6], context=RequestContext("x", adapter="nope"))
    config = ModelConfig.from_model_dir(folder)
    with pytest.raises(ValueError, match="rank 16 is over --max-lora-rank 8"):
        load_adapter(LoRAModuleSpec("all-r16", str(root / "all-r16")), config, max_rank=8)
    bad = root / "bad-target"
    shutil.copytree(root / "attn-r4", bad)
    meta = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**meta, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(ValueError, match=r"unsupported target modules \['lm_head'\]"):
        engine.load_lora_adapter(LoRAModuleSpec("bad", str(bad)))
    other, _ = save_tiny_model("llama", hidden_size=32, intermediate_size=96, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="another base model"):
        load_adapter(LoRAModuleSpec("attn-r4", str(root / "attn-r4")), ModelConfig.from_model_dir(other), 16)
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        engine.load_lora_adapter(LoRAModuleSpec("empty", str(root / "missing")))
    # The engine still serves after every refusal, and a run-time load serves at once.
    engine.load_lora_adapter(LoRAModuleSpec("late", str(root / "mlp-r8")))
    prompt = [7, 8, 9, 10]
    assert _run(engine, [("late", prompt)]) == _references(hf, root, [("mlp-r8", prompt)])
    assert engine.unload_lora_adapter("late") and not engine.unload_lora_adapter("late")


def test_lora_modules_parse_vllms_two_forms():
    specs = parse_lora_modules('a=/x/a\n{"name": "b", "path": "/x/b", "base_model_name": "m"}')
    assert specs == (LoRAModuleSpec("a", "/x/a"), LoRAModuleSpec("b", "/x/b", "m"))
    with pytest.raises(ValueError, match="unique"):
        parse_lora_modules("a=/x\na=/y")
    with pytest.raises(ValueError, match="name=path or JSON"):
        parse_lora_modules("just-a-path")


def test_tensor_parallel_ranks_split_the_adapters_and_match_peft(served):
    """TP 2: each rank holds B's rows of q/k/v/gate/up and A's columns of o/down (as vLLM splits
    them); rank 0's slot table reaches the other rank with each step."""
    from testkit.tensor_parallel import GroupJob, run_group

    folder, hf, root = served
    rng = random.Random(11)
    adapters: list[str | None] = [*ADAPTERS, None, "all-r16"]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 30, 17, 12, 5)]
    config = EngineConfig(
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        enable_lora=True,
        lora_modules="\n".join(f"{n}={root / n}" for n in ADAPTERS),
        max_loras=2,  # three adapters in the batch: slots change hands between steps
    )
    (result,) = run_group([GroupJob(folder, prompts, NEW_TOKENS, adapters=adapters)], 2, config)
    assert result.token_ids == _references(hf, root, list(zip(adapters, prompts)))
    assert result.steps_run[0] == result.steps_run[1]


def test_speculative_decoding_verifies_drafts_under_each_adapter(served):
    """ngram drafts from the prompt, verified by the target under the request's adapter: the same
    greedy tokens as peft, with drafts proposed and some accepted."""
    folder, hf, root = served
    rng = random.Random(13)
    motif = [rng.randrange(3, 512) for _ in range(6)]
    jobs: list[tuple[str | None, list[int]]] = [(a, motif * 4) for a in (*ADAPTERS, None)]
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    engine = _engine(folder, root, speculative_config=spec)
    assert _run(engine, jobs) == _references(hf, root, jobs)
    counts = engine.speculator.counters
    assert counts.num_draft_tokens > 0 and counts.num_accepted_tokens > 0


def test_steps_with_adapter_rows_run_in_the_native_layer_stack(served, monkeypatch):
    """On a CPU whose native kernels build, a float32 engine's steps with adapter rows run the
    decoder layers in one native call (kernels/layer_stack.py with the batched LoRA kernel), and
    still give peft's tokens."""
    from kernels.layer_stack import LayerStack

    folder, hf, root = served
    engine = _engine(folder, root)
    stack = engine.runner.layer_stack
    if stack is None or not stack.takes_lora:
        pytest.skip("no native layer stack with LoRA on this machine")
    runs = {"steps": 0, "with_adapters": 0}
    run = LayerStack.run

    def counted(self, hidden, batch, num_threads):
        runs["steps"] += 1
        runs["with_adapters"] += batch.lora_rows is not None
        return run(self, hidden, batch, num_threads)

    monkeypatch.setattr(LayerStack, "run", counted)
    jobs: list[tuple[str | None, list[int]]] = [("attn-r4", [5, 6, 7, 8, 9]), (None, [3, 4, 5]), ("all-r16", [11, 12])]
    assert _run(engine, jobs) == _references(hf, root, jobs)
    assert runs["with_adapters"] >= NEW_TOKENS - 1  # every decode step of the batch


@pytest.mark.parametrize("base", ["bfloat16", "fp8"])
def test_bfloat16_and_fp8_bases_apply_the_adapter(served, base):
    """On a bfloat16 model and on FP8 weights the first token's logits under an adapter are those
    of transformers + peft in float32 up to the base's rounding, far closer than the base model's
    (so the adapter is applied whatever the base's dtype)."""
    folder, hf, root = served
    overrides = {"dtype": "bfloat16"} if base == "bfloat16" else {"quantization": "fp8"}
    modules = "\n".join(f"{n}={root / n}" for n in ADAPTERS)
    config = EngineConfig(num_kv_blocks=64, enable_lora=True, lora_modules=modules, max_loras=3, **overrides)
    engine = build_engine(ModelConfig.from_model_dir(folder), config, iter_safetensors(folder))
    rng = random.Random(17)
    prompts = {name: [rng.randrange(3, 512) for _ in range(20)] for name in ADAPTERS}
    first: dict[tuple[int, ...], torch.Tensor] = {}
    sampler = engine.sampler

    def recording(logits, rows):
        for row_logits, row in zip(logits, rows):
            first.setdefault(tuple(row.prompt_token_ids), row_logits.float().clone())
        return sampler(logits, rows)

    engine.sampler = recording
    _run(engine, [(name, prompt) for name, prompt in prompts.items()])
    for name, prompt in prompts.items():
        with torch.inference_mode():
            base_logits = hf(torch.tensor([prompt])).logits[0, -1].float()
            model = _peft_model(hf, root, name)
            adapted = model(torch.tensor([prompt])).logits[0, -1].float()
            model.unload()
        ours = first[tuple(prompt)]
        off_adapter, off_base = (ours - adapted).abs().max(), (ours - base_logits).abs().max()
        assert off_adapter < 0.2 * off_base, (name, float(off_adapter), float(off_base))
