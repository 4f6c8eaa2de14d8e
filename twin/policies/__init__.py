"""Alternative serving policies for the twin: Chameleon, Toppings, ELORA (and the S-LoRA baseline).

Stock vLLM stays in ``twin.core``; these run in their own loop (``engine``) so the stock path is
untouched. ``spec`` names the policies and their parameters (and how files record them), ``rules``
holds their decision rules, ``memory`` says which A_max starts under each.
"""

from twin.policies.spec import POLICY_NAMES, STOCK, PolicySpec, parse_overrides, policy_from_name

__all__ = ["POLICY_NAMES", "STOCK", "PolicySpec", "parse_overrides", "policy_from_name"]
