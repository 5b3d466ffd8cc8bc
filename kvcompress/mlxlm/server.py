"""What ``kvcompress serve`` takes from mlx-lm's server (``mlx_lm.server``), checked.

* :func:`check_mlx_lm` -- the installed mlx-lm is a supported version and has the names used;
* :func:`model_provider` -- mlx-lm's ``ModelProvider`` with :func:`kvcompress.attach` after each
  load, so every cache the server builds (``make_prompt_cache(model)``, inside ``BatchGenerator``
  and for single requests) is compressed; compressed caches implement ``merge``, so continuous
  batching stays on. A draft model (speculative decoding) keeps mlx-lm's own caches.

The HTTP layer, request checks and supervision are :mod:`kvcompress.serve`'s; the prompt cache is
:class:`~kvcompress.mlxlm.prompt_cache.CompressedPromptCache`.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import KVCompressError

__all__ = ["SUPPORTED_MLX_LM", "check_mlx_lm", "model_provider"]

#: mlx-lm minor versions whose server/chat internals kvcompress serve and chat were tested with
SUPPORTED_MLX_LM = ("0.32",)


#: what kvcompress serve uses of mlx_lm.server
SERVER_NAMES = ("ModelProvider", "ResponseGenerator", "GenerationContext", "GenerationArguments", "CompletionRequest",
                "ModelDescription", "SamplingArguments", "LogitsProcessorArguments", "ToolCallFormatter", "BatchGenerator",
                "get_system_fingerprint", "_image_parts", "_inline_image_urls", "main")


def check_mlx_lm(module: str = "mlx_lm.server", names: Sequence[str] = SERVER_NAMES):
    """Raise KVCompressError unless the installed mlx-lm is a supported version whose ``module``
    has the hook points ``names``."""
    import importlib

    import mlx_lm

    version = getattr(mlx_lm, "__version__", "?")
    minor = ".".join(version.split(".")[:2])
    if minor not in SUPPORTED_MLX_LM:
        raise KVCompressError(
            f"mlx-lm {version} is not supported by kvcompress serve/chat (supported: "
            f"{', '.join(v + '.x' for v in SUPPORTED_MLX_LM)}); install one with "
            f"pip install 'mlx-lm>={SUPPORTED_MLX_LM[0]},<{_next(SUPPORTED_MLX_LM[-1])}'"
        )
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise KVCompressError(f"mlx-lm {version}: {module} lacks {missing}, which kvcompress hooks into")
    return version


def _next(minor: str) -> str:
    major, m = minor.split(".")
    return f"{major}.{int(m) + 1}"


def model_provider(method):
    """mlx-lm's ``ModelProvider`` whose every loaded model gets ``method`` attached (so each
    cache the server builds is compressed), whose ``--model`` loads at construction (a bad model
    or budget is refused before the server listens), and which knows the default model by the
    names a client may use for it (``default_model``, ``--model`` as given, its resolved path)."""
    from pathlib import Path

    import mlx_lm.server as srv

    from ..factory import attach

    class ModelProvider(srv.ModelProvider):
        def __init__(self, cli_args):
            super().__init__(cli_args)
            name = getattr(cli_args, "model", None)
            if name is None:
                return
            aliases = {name}
            if Path(name).exists():
                aliases.add(str(Path(name).resolve()))
            for alias in aliases:
                self._model_map[alias] = name
                self._adapter_map[alias] = cli_args.adapter_path
            try:
                self.load_default()
            except KVCompressError:
                raise
            except Exception as exc:
                raise KVCompressError(f"cannot load --model {name!r}: {type(exc).__name__}: {exc}") from None

        def load(self, model_path, adapter_path=None, draft_model_path=None):
            """mlx-lm's; a model a request names that cannot be loaded (or compressed) is that
            request's error (404 / 400), not the server's."""
            from ..serve.errors import ModelNotFound, RequestError

            try:
                return super().load(model_path, adapter_path, draft_model_path)
            except KVCompressError as exc:
                if model_path == "default_model":
                    raise
                raise RequestError(f"model {model_path!r} cannot be served with this method: {exc}",
                                   param="model") from None
            except Exception as exc:
                if model_path == "default_model" and self.cli_args.model is not None:
                    raise
                why = " ".join(str(exc).split())[:300]
                raise ModelNotFound(f"model {model_path!r} could not be loaded ({type(exc).__name__}: {why})",
                                    param="model", code="model_not_found") from None

        def _load(self, *args, **kwargs):
            super()._load(*args, **kwargs)
            attach(self.model, method, tokenizer=self.tokenizer)

    return ModelProvider
