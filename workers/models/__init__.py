"""Model families on the paged KV cache: their torch classes (llama, gemma, moe), their torch-free
declarations (families/, one ModelFamily each, listed once by registry, which every lookup reads),
their config.json (config), and the files of a model folder (files, checkpoint)."""
