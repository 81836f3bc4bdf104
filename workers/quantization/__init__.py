"""Linear layers as stored and run: FP8 weights with their scales (fp8), and oneDNN-prepacked weights on the CPU;
the quantization methods by name (registry: the configuration's names, and the method the loader runs)."""
