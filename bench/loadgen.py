"""Load generator for an OpenAI-compatible endpoint: TTFT, TPOT, ITL, E2EL percentiles, throughput, goodput.

    python -m bench.serve --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 16 \
        --input-len 256 --output-len 128 --ignore-eos --out bench/results/serve.json

Arrivals: fixed concurrency (--max-concurrency) or Poisson at --request-rate R per second (or both).
Prompts: random token-ish words of about --input-len tokens, or --shared-prefix-len tokens of a
common prefix followed by a random tail. Streams /v1/chat/completions (or /v1/completions with
--endpoint) and times every SSE chunk. Definitions follow vLLM's benchmark: TTFT from sending the
request to the first token; TPOT = (E2EL - TTFT) / (output tokens - 1); ITL = gaps between chunks;
goodput = completed requests per second meeting every SLO given (--slo-ttft-ms, --slo-tpot-ms).
Traffic goes only where --base-url points; keep it on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common.stats import summary as latency_summary

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy"
).split()


@dataclass
class RequestResult:
    ok: bool
    prompt_chars: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def make_prompt(rng: random.Random, approx_tokens: int, prefix: str = "") -> str:
    # About 1.3 tokens per common English word with a leading space.
    n = max(1, int(approx_tokens / 1.3))
    return prefix + " ".join(rng.choice(WORDS) for _ in range(n))


async def one_request(client: httpx.AsyncClient, args, prompt: str | list[int]) -> RequestResult:
    result = RequestResult(ok=False, prompt_chars=len(prompt))
    if isinstance(prompt, list) or args.endpoint == "/v1/completions":
        body = {"model": args.model, "prompt": prompt}
    else:
        body = {"model": args.model, "messages": [{"role": "user", "content": prompt}]}
    body.update(
        {
            "max_tokens": args.output_len,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    if args.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", args.endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage") and not chunk.get("choices"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    continue
                choice = chunk["choices"][0] if chunk.get("choices") else None
                piece = (
                    choice.get("delta", {}).get("content") if "delta" in (choice or {}) else (choice or {}).get("text")
                )
                if not piece:
                    continue
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        result.e2el_s = time.perf_counter() - start
        result.ok = result.ttft_s > 0
        if not result.ok:
            result.error = "no tokens"
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


def summarize(results: list[RequestResult], duration_s: float, args) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    good = [
        r
        for r in done
        if (args.slo_ttft_ms is None or r.ttft_s * 1000 <= args.slo_ttft_ms)
        and (args.slo_tpot_ms is None or r.tpot_s is None or r.tpot_s * 1000 <= args.slo_tpot_ms)
    ]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_output_tokens": out_tokens,
        "goodput": len(good) / duration_s,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "ttft_ms": latency_summary([r.ttft_s for r in done]),
        "tpot_ms": latency_summary([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": latency_summary([x for r in done for x in r.itl_s]),
        "e2el_ms": latency_summary([r.e2el_s for r in done]),
    }


async def run(args) -> dict:
    rng = random.Random(args.seed)
    prefix = make_prompt(rng, args.shared_prefix_len) + " " if args.shared_prefix_len else ""
    if args.token_ids:
        # Exact lengths: random ids from the middle of the vocabulary, sent to /v1/completions.
        args.endpoint = "/v1/completions"
        shared = [rng.randrange(1000, 40000) for _ in range(args.shared_prefix_len)]
        prompts = [
            shared + [rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts)
        ]
    else:
        prompts = [make_prompt(rng, args.input_len, prefix) for _ in range(args.num_prompts)]
    limits = httpx.Limits(max_connections=max(args.max_concurrency or 0, 1) + 64)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        semaphore = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def gated(prompt) -> RequestResult:
            async with semaphore:
                return await one_request(client, args, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/chat/completions", choices=("/v1/chat/completions", "/v1/completions"))
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--shared-prefix-len", type=int, default=0)
    p.add_argument(
        "--token-ids",
        action="store_true",
        help="send exact-length prompts as token ids to /v1/completions (input-len is then exact)",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None, help="write the JSON summary here (e.g. bench/results/serve.json)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    summary = asyncio.run(run(args))
    summary["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    summary["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return summary


if __name__ == "__main__":
    main()
