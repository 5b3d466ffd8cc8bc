"""Glue between kvcompress and mlx-lm, in one place.

* :mod:`.attention` -- the attention wrapper that hands each step's queries to a compressed cache
  (and lets it apply its exact slot mask), plus the layer input/output hook some budgets need;
* :mod:`.loader` -- registers the cache classes with ``mlx_lm.models.cache`` so mlx-lm's own
  ``load_prompt_cache`` (and its CLIs' ``--prompt-cache-file``) read kvcompress files;
* :mod:`.prompt_cache` -- the server's prompt cache, exact for compressed entries;
* :mod:`.server` -- what ``kvcompress serve`` (:mod:`kvcompress.serve`) takes from mlx-lm's server;
* :mod:`.commands` -- ``kvcompress serve`` and ``kvcompress chat`` (over mlx-lm's chat).

The cache engine never imports mlx-lm's server nor any of these modules (:mod:`.attention`
registers what the engine runs before each update), and these modules only use the caches'
public protocol.
"""
