"""Linear layers as stored and run: FP8 weights with their scales (fp8), and oneDNN-prepacked weights on the CPU."""
