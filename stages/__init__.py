"""Sluice stages, in sub-packages along the data's path: ``data`` (source → dataset artifact),
``load`` (artifact → ordered, augmented batches), ``select`` (candidate batch → selected batch),
``train`` (selected batches → a trained model), over ``contracts`` (batches and the protocols
between stages), ``models`` and ``compute`` (precision, optimizer, normalisation), which every
stage may use. A stage imports only downward (load never imports train); none imports Prefect;
heavy backends (FFCV, DALI) are imported only when asked for.
"""
