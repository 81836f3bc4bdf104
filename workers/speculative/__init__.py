"""Speculative decoding: the speculator an engine is built with, its proposers (ngram, suffix, a
draft model) and the budget of how many drafts pay."""
