"""Model families on the paged KV cache (llama, gemma, moe; registry maps an architecture to its
class), their config.json (config), and the files of a model folder (files, checkpoint)."""
