"""The load generator (bench/loadgen.py, which tests and the other benchmarks import), as a
benchmark: `python -m bench.serve --base-url http://127.0.0.1:8000 --num-prompts 64 ...`."""

from bench.loadgen import main

if __name__ == "__main__":
    main()
