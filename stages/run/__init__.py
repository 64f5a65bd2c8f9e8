"""A training run as the pipeline drives it, free of Prefect so a user can call it from Python,
for every kind of data (what differs by kind is the kind's: ``stages/kinds``): where tonight's
weights start (``warm``, ``replay``), the job assembled once from the stage configs
(``assemble``), the ranks launched here, in-process or under torchrun (``launch``,
``rendezvous``), across listed nodes (``nodes``) or a Ray cluster's nodes (``ray_nodes``, each node's
torchrun run by a ``node_agent``), progress watched (``training.run_training``: the
one call a flow makes), and the candidate graded and promoted (``grading``, ``promote``). What a
rank runs is ``sluice.stages.train.rank``; this package never runs inside a rank.

    from sluice.stages.run.launch import launch, make_job
    result = launch(make_job(train_config, data_spec), nproc=2)
"""
