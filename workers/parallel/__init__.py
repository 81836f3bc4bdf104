"""Tensor parallelism inside a worker: a group of ranks that each hold a shard of every layer.

`ShardPlan` says what rank r of a TP group of size N holds, from the model's ModelConfig alone:
its query heads (an even split), its KV heads (an even split when num_kv_heads >= N; when N
exceeds num_kv_heads each rank keeps the one KV head its query heads read, rank * num_kv_heads
// N, so a head is replicated N // num_kv_heads times, as vLLM does) and its slice of the MLP's
intermediate dimension. `ShardPlan.model_config` is the rank's view of the model (its head and
intermediate counts): the model, its KV cache and the attention kernels are built from it
unchanged, so the KV cache of a rank holds only its KV heads.

Mixture-of-experts models keep the router whole on every rank and split the experts by their
intermediate channels (each rank every expert's 1/N, like a dense MLP) or, with expert parallelism,
whole (each rank 1/N of the experts, `ModelConfig.local_experts`); workers/models/moe.py says how
each runs.

`ShardedCheckpoint` slices the Hugging Face tensors on the way into `load_hf_weights`:
column-parallel q/k/v and gate/up keep the rank's output rows (Qwen2's q/k/v biases and FP8
per-channel weight scales with them), row-parallel o_proj and down_proj keep the rank's input
columns, and their biases are kept on rank 0 only (zeros elsewhere) so the one all-reduce after
each (`TPGroup.all_reduce`, which the model's Attention and MLP call) adds them once. Qwen3's
q/k norms are per head_dim, so every rank keeps them whole.

The embedding and lm_head are replicated, not vocab-parallel: the vocabularies served here are
small next to the layers, replication needs no all-gather of logits, and since every rank's
hidden states are the same after the last all-reduce, every rank computes the same logits and
samples the same token, so rank 0's sample is every rank's.

Only rank 0 schedules: its LLMEngine (block manager, scheduler, sampler) is the worker as the
router sees it. Its ModelRunner broadcasts each step's inputs (`StepInputs`, plain lists) to the
other ranks before running the step; they run the same forward pass on their shards
(`ModelRunner.follow`), joined by the all-reduces, and compute no logits. The KV block ids
rank 0's block manager picks index every rank's cache alike, so a rank's cache holds its heads of
the same blocks. `workers.parallel.rank` is a non-zero rank as a worker process;
`workers.shell.actors` places the ranks of one worker on one node (a placement group).

Modules: `group` (TPGroup: the all-reduce and the step broadcast), `sharding` (ShardPlan,
ShardedCheckpoint, load_sharded_model), `shard` (a rank's model and its KV cache allocated
through its transport), `rank` (a non-zero rank as a worker process).
"""
