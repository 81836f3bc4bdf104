"""Test scaffolding: fakes, harnesses and builders that tests and benchmarks use; product code never imports it."""
