"""`FusedFeatureProcessor`: the drop-in module for per-feature LayerNorm -> tanh -> Linear -> relu.

A recommender model usually writes this as a loop over features (one LayerNorm per feature, a
shared Linear); the module owns the same parameters stacked as [F, ...] tensors and runs every
feature of one embedding dim in a single `recfuse.ln_tanh_linear_relu` call on a strided view of
the pooled embeddings, so a torchrec KeyedTensor's [B, F*D] buffer is never copied.

Parts, in the order a call meets them:

* `inputs.py`: the input adapters (KeyedTensor, [B, sum(D)], [B, F, D] / [F, B, D], dict): one
  dispatch on the input's kind, the checks by feature name, the per-slice reference per kind;
* `plan.py`: the plan of a call (which op calls, on which views, with which parameter rows),
  built and validated once per call signature, with the op's own argument checks;
* `parameters.py`: the stacked parameters, their initialisation, per-feature views, and
  `from_modules`' reading of a per-feature loop's modules;
* `features.py`: the feature names and dims the module was built for, grouped by dim;
* `processor.py`: the nn.Module that wires them together.

Example:
    >>> import torch
    >>> from recfuse.module import FusedFeatureProcessor
    >>> fp = FusedFeatureProcessor(["user", "item"], 8, out_features=2)
    >>> x = torch.randn(4, 16)
    >>> torch.allclose(fp(x), fp.forward_reference(x), atol=1e-6)
    True
"""
from .processor import FusedFeatureProcessor

__all__ = ["FusedFeatureProcessor"]
