"""Benchmarks: ``pipeserve bench throughput`` (offline, with a transformers baseline)
and ``pipeserve bench serve`` (online, against any OpenAI-compatible server),
their workloads, latency math, plots and the results table of benchmarks/README.md."""
