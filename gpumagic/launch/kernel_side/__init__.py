"""What runs in the kernel: the launch API, local and elastic launches, process sets, the persistent group and
its recovery, per-rank output in cells, and what happens when the kernel ends."""
