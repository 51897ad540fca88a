"""``log()`` in workers, the durable metrics store and samplers of GPU/process state (issue #4)."""
