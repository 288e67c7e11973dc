"""rl: the two users of mok's ops: a training wrapper for transformers models and a vLLM sampling hook."""
