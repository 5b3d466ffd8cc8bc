"""Benchmarks for kvcompress (library side; the command-line wrappers live in ``benchmarks/``).

* :mod:`kvcompress.bench.synthetic` -- model-free output perturbation of every registered method
  on structured synthetic K/V (``run_synthetic``).
* :mod:`kvcompress.bench.speed` -- decode tokens/s and prefill time of compressed caches against
  mlx-lm's ``RotatingKVCache`` on a random-weight Llama (``run_speed``), plus a decode profile.
* :mod:`kvcompress.bench.scaling` -- speed and memory (cache bytes, peak memory) of every method
  against context length at several budgets (``run_scaling``).
* :mod:`kvcompress.bench.retrieval` -- retrieval accuracy on the embedded model (``run_retrieval``).
* :mod:`kvcompress.bench.perplexity` -- streaming perplexity on a real model (``run_perplexity``).
* :mod:`kvcompress.bench._report` -- shared JSON / plot / table helpers (machine metadata).

Submodules are imported on demand so that importing :mod:`kvcompress.bench` stays cheap and
does not need the optional ``bench`` extras (matplotlib, rich).
"""
