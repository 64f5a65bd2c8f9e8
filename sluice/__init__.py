"""Sluice: data-centric, efficient training pipelines.

Everything installed lives under this one package:

* ``sluice.storage``: artifacts, manifests, fingerprints, atomic writes, scores, checkpoints,
  the model registry (no torch, no Prefect);
* ``sluice.stages``: the stages along the data's path — ``data`` (sources → dataset artifact),
  ``load`` (order, batches, augmentation, backends), ``select`` (sample selection), ``train``
  (the loop, evaluation, gradient communication, torchrun) — over ``stages.contracts``; never
  Prefect;
* ``sluice.flows``: the Prefect flows, the pipeline config and the ``sluice`` CLI.

``sluice.errors`` holds the one error hierarchy; ``sluice.plugins`` the registries through
which each axis of variation is extended (and each entry's own params); ``sluice.process_rules`` every
rule about forking and spawning processes.

In the repository these packages are the top-level folders ``storage/``, ``stages/`` and
``flows/`` (mapped by ``package-dir`` in ``pyproject.toml``); this folder holds only what sits
below all of them.
"""
__version__ = "0.2.0"
