"""``log()`` in workers and the kernel, samplers of GPU and process state, and the kinds of metrics (which are
better high). The run directory they write to, with its metrics store, is ``run_dirs``, the floor below."""
