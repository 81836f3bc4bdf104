"""The `baton` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.config import TRANSPORTS, ServeConfig
from router.routing import POLICIES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="model folder or .gguf file (same as --model)")
    serve.add_argument("--model", help="Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--served-model-name", dest="served_model_name")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--prefill-workers", type=int, dest="prefill_workers", help="prefill pool size (default 1)")
    serve.add_argument("--decode-workers", type=int, dest="decode_workers", help="decode pool size (default 1)")
    serve.add_argument("--block-size", type=int, dest="block_size", help="tokens per KV block (default 16)")
    serve.add_argument("--kv-cache-memory", dest="kv_cache_memory", help="KV cache per worker, bytes or e.g. 2GB (default 1GiB)")
    serve.add_argument("--max-num-seqs", type=int, dest="max_num_seqs")
    serve.add_argument("--max-num-batched-tokens", type=int, dest="max_num_batched_tokens")
    serve.add_argument("--max-model-len", type=int, dest="max_model_len")
    serve.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    serve.add_argument("--quantization", choices=("fp8",),
                       help="fp8: quantize every linear layer to FP8 (e4m3, per-channel scales) at load time; "
                            "FP8 checkpoints load as FP8 without it")
    serve.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=("auto", "fp8"),
                       help="KV cache dtype (default auto: the model dtype); fp8: e4m3 with calibrated per-layer scales")
    serve.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False)
    serve.add_argument("--transport", choices=TRANSPORTS, help="KV transport (default auto: nccl on GPU, shared memory on CPU)")
    serve.add_argument("--address", help="join this Ray cluster instead of starting one on 127.0.0.1")
    serve.add_argument("--threads-per-worker", type=int, dest="threads_per_worker")
    serve.add_argument("--routing-policy", dest="routing_policy", choices=POLICIES,
                       help="how the router picks workers (default kv-aware: prefix overlap + load)")
    serve.add_argument("--local-prefill-threshold", type=int, dest="local_prefill_threshold",
                       help="uncached prompt tokens at or below which the decode worker prefills itself (default 64)")
    serve.add_argument("--prefill-queue-threshold", type=int, dest="prefill_queue_threshold",
                       help="queued prefill tokens per prefill worker beyond which decode workers prefill locally (default 8192)")
    serve.add_argument("--routing-temperature", type=float, dest="routing_temperature",
                       help="softmax temperature of the kv-aware policy, relative to the prompt length (default 0.1; 0: argmin)")
    serve.add_argument("--config", help="YAML file with any of these options (flags win)")
    serve.add_argument("--log-level", dest="log_level", choices=("debug", "info", "warning", "error"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        options = vars(args).copy()
        for key in ("command", "config", "model_arg"):
            options.pop(key)
        if args.model_arg and args.model:
            print("baton serve: give the model once, as MODEL or --model", file=sys.stderr)
            return 2
        options["model"] = args.model or args.model_arg
        try:
            config = ServeConfig.load(args.config, options)
        except ValueError as exc:
            print(f"baton serve: {exc}", file=sys.stderr)
            return 2
        logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from cluster.launcher import serve

        try:
            serve(config)
        except ValueError as exc:  # ModelNotFoundError, KV layout mismatches, bad settings
            print(f"baton serve: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            pass
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
