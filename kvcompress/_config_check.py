"""``kvcompress config validate FILE``: a method config checked as far as it can be without a model."""

from __future__ import annotations

import sys

__all__ = ["NOMINAL_LAYERS", "check_layer_budgets", "cmd_config_validate"]

#: Layer counts ``config validate`` evaluates a budget for, without a model.
NOMINAL_LAYERS = (1, 2, 8, 32)


def check_layer_budgets(method, layer_counts=NOMINAL_LAYERS) -> None:
    """Raise ConfigError unless every layer budget, for each nominal layer count, leaves room to
    evict past the selector's reserved tokens (what building the caches would check)."""
    from .components import ModelInfo
    from .engine.rows import room_to_evict
    from .errors import ConfigError

    budget, selector = method.config.budget.name, method.config.selector.name
    for n in layer_counts:
        where = f"budget {budget!r} for a {n}-layer model"
        try:
            budgets = method.budget.layer_budgets(ModelInfo(n_layers=n))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        for layer, b in enumerate(budgets):
            if not room_to_evict(method.selector, b):
                reserved = method.selector.reserved(int(b))
                from .factory import smallest_budget

                size = getattr(method.budget, "budget", None)
                least = smallest_budget(method, ModelInfo(n_layers=n), size) if isinstance(size, int) else None
                raise ConfigError(
                    f"{where}: layer {layer} gets {b} tokens but selector {selector!r} always keeps "
                    f"{reserved} (sinks + recent window); "
                    + (f"the smallest budget that builds is {least}" if least else "raise the budget")
                    + " or protect fewer tokens"
                )


def cmd_config_validate(args) -> int:
    from .config import load_config
    from .errors import KVCompressError
    from .method import build_method

    try:
        method = build_method(load_config(args.file))
        check_layer_budgets(method)
    except KVCompressError as exc:
        print(f"{args.file}: invalid: {exc}", file=sys.stderr)
        return 2
    print(f"{args.file}: ok")
    print(method.describe())
    print(f"checked: names, parameters, composition, and layer budgets for "
          f"{', '.join(map(str, NOMINAL_LAYERS))} layers; left to build time: the model's layer count "
          "and head dim, and data-driven budgets (e.g. squeeze re-splits after the prompt)")
    return 0
