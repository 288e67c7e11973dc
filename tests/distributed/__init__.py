"""Multi-process tests (expert parallelism, FSDP2), spawned by the tests themselves: harness.py."""
