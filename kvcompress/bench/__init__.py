"""Benchmarks for kvcompress: small workloads over one shared harness.

Workloads (each exposes ``add_arguments(parser)`` and ``run(args)`` for ``kvcompress bench
<workload>``, and a ``run_*`` function for library use):

* :mod:`kvcompress.bench.retrieval` -- retrieval accuracy on the embedded model (``run_retrieval``;
  episodes in :mod:`~kvcompress.bench.retrieval_data`).
* :mod:`kvcompress.bench.perplexity` -- streaming perplexity on a real model (``run_perplexity``).
* :mod:`kvcompress.bench.synthetic` -- model-free output perturbation of every registered method
  on structured synthetic K/V (``run_synthetic``; streams in :mod:`~kvcompress.bench.synthetic_data`).
* :mod:`kvcompress.bench.speed` -- decode tokens/s and prefill time against mlx-lm's
  ``RotatingKVCache`` on a random-weight Llama (``run_speed``), with a decode profile.
* :mod:`kvcompress.bench.scaling` -- speed and memory of every method against context length at
  several budgets (``run_scaling``).
* :mod:`kvcompress.bench.storage` -- low-bit storage (``kv_bits``): decode speed paired against the
  same method's float storage, and bytes against a full float16 cache (``run_storage``).

Shared pieces:

* :mod:`~kvcompress.bench._caches` -- the caches compared (methods, ``full``, ``rotating``) and
  their sizes.
* :mod:`~kvcompress.bench._model` -- the random-weight Llama the speed workloads time.
* :mod:`~kvcompress.bench._harness` -- timing, interleaved / lockstep scheduling, paired ratios,
  medians, peak memory.
* :mod:`~kvcompress.bench._profile` -- the per-layer profiler and MLX op counter.
* :mod:`~kvcompress.bench._options` -- option types, output options, settings checks.
* :mod:`~kvcompress.bench._report` -- machine metadata, JSON, tables, plots, the end of a run.

Submodules are imported on demand so that importing :mod:`kvcompress.bench` stays cheap and
does not need the optional ``bench`` extras (matplotlib, rich).
"""
