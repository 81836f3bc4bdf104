"""Baton kernels: Triton kernels, each beside its PyTorch reference and its checked host wrapper.

The engine calls only the functions `kernels.ops.kernel_ops(backend, device)` resolves once, when
the model is built: Triton on CUDA and, on the CPU, native C++ kernels (kernels/csrc/, built by
kernels/cpu_native.py) where there is one, else the PyTorch references. EngineConfig.kernel_backend
("auto", "triton", "native", "reference") picks; with `TRITON_INTERPRET=1` the Triton kernels run
on CPU tensors.

One kernel per module: rms_norm, rotary (and the RoPE cache), silu_mul, kv_store, decode_attention
(split-K) with decode_attention_reduce (its merge), prefill_attention, sampling (the exponential
race that draws every sampled row's token in one pass), fp8_quant, fp8_gemm,
block_copy (KV pack/unpack for network transfers, and the native cache-to-cache copy that
kvtransfer's shared-memory backend calls directly). Modules starting with `_` hold shared checks
and helpers, no kernels.
"""
