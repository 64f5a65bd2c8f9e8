"""A dataset artifact → ordered, augmented batches: samplers, the sample index, augmentation
ops, the loader backends and the ``Loader`` that drives them."""
